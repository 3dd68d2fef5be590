"""Sharding vocabulary: per-dimension mesh axes plus a pending-sum (partial) state.

Words as in DTensor: a dimension is Replicated or Sharded over mesh axes; a
tensor is Partial over axes when each device holds a summand of the true value
(what `dot_general` produces when its contracting dimension is sharded).
Strategy names print XLA style: `S[data]R` is a 2-D tensor sharded on dim 0
over `data`, replicated on dim 1; a `+P[model]` suffix marks a partial sum.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import PartitionSpec

Axes = tuple[str, ...]


def hash_once(cls):
    """Class decorator for a frozen dataclass that keys many of the search's tables
    (`Spec`, `TensorType`): its hash, of its fields, is computed once per object and
    kept out of pickles (string hashes differ between processes)."""
    names = tuple(f.name for f in dataclasses.fields(cls))

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, n) for n in names))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:  # memos (`_hash`, `_shards`) stay out of pickles
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    cls.__hash__, cls.__getstate__ = __hash__, __getstate__
    return cls


@hash_once
@dataclass(frozen=True, order=True)
class Spec:
    dims: tuple[Axes, ...]
    partial: Axes = ()

    @staticmethod
    def replicated(rank: int) -> Spec:
        return Spec(((),) * rank)

    @staticmethod
    def from_pspec(pspec: PartitionSpec | Sequence, rank: int) -> Spec:
        entries = list(pspec) + [None] * (rank - len(pspec))
        dims = []
        for e in entries[:rank]:
            if e is None:
                dims.append(())
            elif isinstance(e, str):
                dims.append((e,))
            else:
                dims.append(tuple(e))
        return Spec(tuple(dims))

    @staticmethod
    def from_json(entries: Sequence) -> Spec:
        return Spec.from_pspec(entries, len(entries))

    def to_pspec(self) -> PartitionSpec:
        return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else a for a in self.dims])

    def stacked_pspec(self) -> PartitionSpec:
        """The layout of a Partial value held stacked, one summand per device of its
        partial axes in a leading dim: that dim split over them, the rest as `dims`."""
        lead = self.partial[0] if len(self.partial) == 1 else tuple(self.partial)
        return PartitionSpec(lead, *self.without_partial().to_pspec())

    def to_json(self) -> list:
        return [None if not a else a[0] if len(a) == 1 else list(a) for a in self.dims]

    @property
    def used_axes(self) -> Axes:
        got = self.__dict__.get("_used")  # a memo, as `_shards` (a build asks ~10^5 times)
        if got is None:
            got = tuple(a for d in self.dims for a in d)
            object.__setattr__(self, "_used", got)
        return got

    def without_partial(self) -> Spec:
        if not self.partial:
            return self
        got = self.__dict__.get("_whole")  # a memo: reshard pricing asks ~10^5 times
        if got is None:
            got = Spec(self.dims)
            object.__setattr__(self, "_whole", got)
        return got

    def axis_dims(self) -> dict[str, int]:
        """The dim each used axis shards (one dict per spec, kept: not to be changed)."""
        got = self.__dict__.get("_axis_dims")
        if got is None:
            got = {a: i for i, d in enumerate(self.dims) for a in d}
            object.__setattr__(self, "_axis_dims", got)
        return got

    def summed_into(self, dst: Spec) -> Spec:
        """The dense layout this spec's pending sums leave on the way to `dst`: each
        partial axis that `dst` shards a dim with (and this spec uses nowhere) is
        reduce-scattered onto that dim, after the axes already there; the others are
        all-reduced (`autopar.cost.model.reshard_steps` prices it so, the lowering
        constrains the sum to it)."""
        used, want = set(self.used_axes), dst.axis_dims()
        grown = [list(d) for d in self.dims]
        for a in self.partial:
            if a in want and a not in used:
                grown[want[a]].append(a)
        return Spec(tuple(map(tuple, grown)))

    def gather_last(self, dst: Spec) -> Spec:
        """Where a reshard from this dense spec to dense `dst` stops before its
        all-gather: `dst`, plus the axes `dst` drops still in the dims they shard
        here. Reaching it moves (all-to-all) or slices; leaving it only gathers.
        Gathering first would move and gather whole values: XLA, told only `dst`,
        all-gathers `S[data,model]` over both axes before it slices for `RS[model]`."""
        used = set(dst.used_axes)
        return Spec(
            tuple(w + tuple(a for a in d if a not in used) for w, d in zip(dst.dims, self.dims))
        )

    def move_steps(self, dst: Spec) -> tuple[Spec, ...] | None:
        """The way from this dense spec to `self.gather_last(dst)` one axis at a time:
        the spec after each step, or None when there is no such way.

        A step either slices a new axis onto a dim (local) or takes the minor-most
        axis of one dim and appends it to the dim `dst` wants it in, which XLA does
        as one all-to-all over that axis. Slices go first, so the moves carry
        `dst`'s blocks. Told to move axes out of several dims at once
        (`S[model]S[data]R` to `RRS[stage,data,model]`), XLA gathers the whole value
        instead ("involuntary full rematerialization"). None when an axis is not
        minor-most where it must leave, as `S[data,model]` to dim 1 in the same
        order (which XLA does in one go)."""
        used_dst = set(dst.used_axes)  # `gather_last(dst)`'s dims, without making it
        goal = [[*w, *(a for a in d if a not in used_dst)] for w, d in zip(dst.dims, self.dims)]
        cur = [list(d) for d in self.dims]
        steps: list[Spec] = []
        while cur != goal:
            todo = [
                (j, goal[j][len(c)])
                for j, c in enumerate(cur)
                if len(c) < len(goal[j]) and goal[j][: len(c)] == c
            ]
            used = {a for c in cur for a in c}
            fresh = [(j, a) for j, a in todo if a not in used]
            ready = [(j, a) for j, a in todo if any(c[-1:] == [a] for c in cur)]
            if not fresh + ready:
                return None
            j, a = (fresh + ready)[0]
            for c in cur:
                if c[-1:] == [a]:
                    c.pop()
            cur[j].append(a)
            steps.append(Spec(tuple(map(tuple, cur))))
        return tuple(steps)

    def without_trivial_axes(self, mesh: MeshInfo) -> Spec:
        """The same layout with the mesh's size-1 axes left out: splitting over an axis
        of size 1 splits nothing, and the strategy tables never name one."""
        drop = {a for a in mesh.axis_names if mesh.size(a) == 1}
        if not drop:
            return self
        keep = lambda axes: tuple(a for a in axes if a not in drop)
        return Spec(tuple(keep(d) for d in self.dims), keep(self.partial))

    def shards(self, mesh: MeshInfo) -> int:
        memo = self.__dict__.get("_shards")  # the search asks millions of times, one mesh
        if memo is not None and memo[0] is mesh:
            return memo[1]
        n = math.prod(mesh.size(a) for a in self.used_axes)
        object.__setattr__(self, "_shards", (mesh, n))
        return n

    def local_shape(self, shape: Sequence[int], mesh: MeshInfo) -> tuple[int, ...]:
        return tuple(s // math.prod(mesh.size(a) for a in d) for s, d in zip(shape, self.dims))

    def __str__(self) -> str:
        body = "".join(f"S[{','.join(d)}]" if d else "R" for d in self.dims) or "scalar"
        return body + (f"+P[{','.join(self.partial)}]" if self.partial else "")


@dataclass(frozen=True)
class MeshInfo:
    """What the cost model needs to know about a mesh: names, sizes, link tiers.

    `device_ids` are in mesh order (row-major over the axes). An axis runs on
    the intra-node link (NVLink) when every group of devices it connects sits in
    one node of `devices_per_node`, otherwise on the inter-node network.
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    device_ids: tuple[int, ...]
    devices_per_node: int

    @staticmethod
    def build(
        names: Sequence[str],
        sizes: Sequence[int],
        device_ids: Sequence[int] | None,
        devices_per_node: int,
    ) -> MeshInfo:
        n = math.prod(sizes)
        ids = tuple(range(n)) if device_ids is None else tuple(int(i) for i in device_ids)
        return MeshInfo(tuple(names), tuple(int(s) for s in sizes), ids, devices_per_node)

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    @functools.cached_property
    def _sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    def size(self, axis: str) -> int:
        return self._sizes[axis]

    def is_intra_node(self, axes: Sequence[str]) -> bool:
        """True when every device group along `axes` stays inside one node."""
        ids = np.array(self.device_ids).reshape(self.axis_sizes)
        keep = [self.axis_names.index(a) for a in axes]
        rest = [i for i in range(len(self.axis_sizes)) if i not in keep]
        groups = np.transpose(ids, rest + keep).reshape(
            -1, math.prod(self.axis_sizes[i] for i in keep)
        )
        nodes = groups // self.devices_per_node
        return bool((nodes == nodes[:, :1]).all())

    def to_json(self) -> dict:
        return {
            "axes": dict(zip(self.axis_names, self.axis_sizes)),
            "device_ids": list(self.device_ids),
        }


def mesh_info(
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, devices_per_node: int
) -> MeshInfo:
    """The mesh as the cost model sees it; `devices_per_node` (a cluster profile's)
    says which axes stay on one node's fast links."""
    names = tuple(mesh.axis_names)
    sizes = tuple(mesh.axis_sizes) if hasattr(mesh, "axis_sizes") else tuple(mesh.shape.values())
    ids = None
    if isinstance(mesh, jax.sharding.Mesh):
        ids = [d.id for d in mesh.devices.flat]
    return MeshInfo.build(names, sizes, ids, devices_per_node)


def axis_order_slow_first(mesh: MeshInfo) -> list[str]:
    """Mesh axes ordered inter-node first (D-Rec cuts across the slowest links first)."""
    return sorted(
        mesh.axis_names, key=lambda a: (mesh.is_intra_node((a,)), mesh.axis_names.index(a))
    )
