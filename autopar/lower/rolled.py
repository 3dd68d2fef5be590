"""The user's leaves in and out of a program whose unrolled layers were rolled into loops.

`autopar.passes.roll` makes one input (output) of the program from the `S` leaves of a
layer slot, one per stage, concatenated along dim 0 (stacked, for scalars); a plan
splits that dim over the stage axis, stage-major, so the rows on stage `s` are exactly
layer `s k + j`'s leaf. Each such leaf therefore lives on its stage's devices only
(`NamedSharding` on the stage's sub-mesh, the group's spec without the stage axis), and
`RolledIO` builds the group from the leaves' device buffers, and the leaves from the
group's, with `jax.make_array_from_single_device_arrays`: no copy and no transfer once
the leaves are where the plan puts them (the first call moves them there; every later
call gets back what the previous one returned). The search offers a group only
stage-major strategies; were one not split so, it would be concatenated and split by
copying (a fallback that keeps the numbers right).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.meshes import stage_meshes
from autopar.passes.roll import Roll

__all__ = ["RolledIO", "abstract_inputs", "member_spec"]


def abstract_inputs(roll: Roll, flat: Sequence[Any]) -> list:
    """The rolled program's abstract inputs for the user's flat leaves `flat`."""
    out = []
    for ms, stacked in zip(roll.inputs, roll.stacked_in):
        x = flat[ms[0]]
        if len(ms) == 1:
            out.append(x)
            continue
        shape = (len(ms),) if stacked else (len(ms) * x.shape[0], *x.shape[1:])
        out.append(jax.ShapeDtypeStruct(shape, x.dtype))
    return out


def member_spec(spec: PartitionSpec, axis: str, stacked: bool = False) -> PartitionSpec | None:
    """A group's spec without its leading stage axis: how one stage's leaf is split
    on the stage's sub-mesh; None unless dim 0 is split over `axis` first. A group of
    scalars (`stacked`) has one row per stage: its leaf is a scalar, split over nothing
    (None where dim 0 is split over more than the stage axis)."""
    if not spec:
        return None
    first = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    if not first or first[0] != axis:
        return None
    rest = first[1:]
    if stacked:
        return None if rest else PartitionSpec(*spec[1:])
    head = None if not rest else rest[0] if len(rest) == 1 else rest
    return PartitionSpec(head, *spec[1:])


class RolledIO:
    """Per call: the user's flat leaves to the rolled program's inputs, and its outputs
    back to the user's flat leaves (module doc)."""

    def __init__(self, roll: Roll, mesh: Mesh, in_specs: Sequence[PartitionSpec], axis: str):
        self.roll, self.mesh, self.axis = roll, mesh, axis
        k = mesh.axis_names.index(axis)
        self.subs = stage_meshes(mesh, axis)
        self.stage_of = {d: idx[k] for idx, d in np.ndenumerate(mesh.devices)}
        self.in_specs = list(in_specs)

    def inputs(self, flat: Sequence[Any]) -> list:
        out = []
        for i, (ms, stacked) in enumerate(zip(self.roll.inputs, self.roll.stacked_in)):
            spec = self.in_specs[i]
            if len(ms) == 1:
                x = flat[ms[0]]
                placed = isinstance(x, jax.Array | np.ndarray)
                out.append(jax.device_put(x, NamedSharding(self.mesh, spec)) if placed else x)
                continue
            out.append(self._group([flat[m] for m in ms], spec, stacked))
        return out

    def _group(self, leaves: list, spec: PartitionSpec, stacked: bool):
        whole = NamedSharding(self.mesh, spec)
        mspec = member_spec(spec, self.axis, stacked)
        if mspec is None:  # not split stage-major: a copy
            every = NamedSharding(self.mesh, PartitionSpec())
            parts = [jax.device_put(x, every) for x in leaves]
            joined = jnp.stack(parts) if stacked else jnp.concatenate(parts, axis=0)
            return jax.device_put(joined, whole)
        arrays = []
        for s, x in enumerate(leaves):
            x = jax.device_put(x, NamedSharding(self.subs[s], mspec))  # no-op once placed
            for shard in x.addressable_shards:
                arrays.append(shard.data.reshape((1,)) if stacked else shard.data)
        x0 = leaves[0]
        shape = (len(leaves),) if stacked else (len(leaves) * x0.shape[0], *x0.shape[1:])
        return jax.make_array_from_single_device_arrays(shape, whole, arrays)

    def outputs(self, outs: Sequence[Any]) -> list:
        flat: list[Any] = [None] * self.roll.user_outputs
        for ms, stacked, y in zip(self.roll.outputs, self.roll.stacked_out, outs):
            if len(ms) == 1:
                flat[ms[0]] = y
                continue
            for m, leaf in zip(ms, self._split(y, len(ms), stacked)):
                flat[m] = leaf
        return flat

    def _split(self, y, S: int, stacked: bool) -> list:
        spec = y.sharding.spec if isinstance(y.sharding, NamedSharding) else None
        mspec = None if spec is None else member_spec(spec, self.axis, stacked)
        if mspec is None:  # not split stage-major: copies
            parts = list(y) if stacked else jnp.split(y, S, axis=0)
            return [jax.device_put(p, NamedSharding(self.subs[s], PartitionSpec()))
                    for s, p in enumerate(parts)]  # fmt: skip
        by_stage: list[list] = [[] for _ in range(S)]
        for shard in y.addressable_shards:
            data = shard.data.reshape(()) if stacked else shard.data
            by_stage[self.stage_of[shard.device]].append(data)
        shape = () if stacked else (y.shape[0] // S, *y.shape[1:])
        return [
            jax.make_array_from_single_device_arrays(
                shape, NamedSharding(self.subs[s], mspec), arrays
            )
            for s, arrays in enumerate(by_stage)
        ]
