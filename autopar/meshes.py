"""Meshes: normalize what users pass, and the logical shapes mesh search tries."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from autopar.errors import MeshError
from autopar.sharding import MeshInfo

MeshLike = Mapping[str, int] | Mesh | AbstractMesh | int | str
# Axis names mesh search gives the shapes it tries, outermost (slowest links) first.
AUTO_AXIS_NAMES = {1: ("data",), 2: ("data", "model"), 3: ("data", "model", "expert")}
MAX_CANDIDATES = 12


def make_mesh(mesh: Mapping[str, int] | Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """A dict of axis sizes, a Mesh or an AbstractMesh -> a mesh with Auto axes.
    Uses the local devices when there are enough, else an AbstractMesh (plan only)."""
    auto = lambda n: (AxisType.Auto,) * n
    if isinstance(mesh, Mesh):
        return Mesh(mesh.devices, mesh.axis_names, axis_types=auto(len(mesh.axis_names)))
    if isinstance(mesh, AbstractMesh):
        if math.prod(mesh.axis_sizes) <= len(jax.devices()):
            return make_mesh(dict(zip(mesh.axis_names, mesh.axis_sizes)))
        return AbstractMesh(
            tuple(mesh.axis_sizes), tuple(mesh.axis_names), axis_types=auto(len(mesh.axis_names))
        )
    if not isinstance(mesh, Mapping) or not mesh:
        raise MeshError(
            "mesh must be a dict of axis sizes like {'data': 2, 'model': 4}, a device count "
            f"(mesh search), 'auto', a jax.sharding.Mesh or an AbstractMesh; got {mesh!r}"
        )
    for name, size in mesh.items():
        if (
            not isinstance(name, str)
            or isinstance(size, bool)
            or not isinstance(size, int | np.integer)
            or size < 1
        ):
            raise MeshError(f"mesh axis {name!r}: size must be a positive int, got {size!r}")
    names, sizes = tuple(mesh), tuple(int(s) for s in mesh.values())
    devices = jax.devices()
    if math.prod(sizes) <= len(devices):
        return Mesh(
            np.array(devices[: math.prod(sizes)]).reshape(sizes), names, axis_types=auto(len(names))
        )
    return AbstractMesh(sizes, names, axis_types=auto(len(names)))


def drops_barriers(mesh: Mesh | AbstractMesh) -> bool:
    """Whether the compiler for `mesh` removes optimization barriers before it schedules
    (XLA:CPU does, right after CSE), so that only data dependencies order ops: on CPU
    devices. An abstract mesh is lowered for GPUs, whose pipeline keeps them."""
    return isinstance(mesh, Mesh) and mesh.devices.flat[0].platform == "cpu"


def mesh_candidates(n: int, devices_per_node: int) -> list[dict[str, int]]:
    """Logical shapes for `n` devices: factorizations into 1-3 axes (each >= 2).
    Device order is row-major, so the last axis is the innermost; shapes whose inner
    axes fit in a node (fast links) come first. At most MAX_CANDIDATES."""
    if n < 1:
        raise MeshError(f"mesh={n}: a device count must be >= 1")
    shapes: list[tuple[int, ...]] = [(n,)]
    for a in range(2, n + 1):
        if n % a:
            continue
        b = n // a
        if b >= 2:
            shapes.append((a, b))
        for c in range(2, b + 1):
            if b % c == 0 and b // c >= 2:
                shapes.append((a, c, b // c))

    def inner_fits(shape):
        return math.prod(shape[1:]) <= devices_per_node if len(shape) > 1 else n <= devices_per_node

    shapes.sort(key=lambda s: (not inner_fits(s), len(s), -s[-1] if len(s) > 1 else 0))
    return [dict(zip(AUTO_AXIS_NAMES[len(s)], s)) for s in shapes[:MAX_CANDIDATES]]


def resolve(mesh: MeshLike, devices_per_node: int) -> list[Mesh | AbstractMesh]:
    """The meshes to plan on: one for an explicit mesh, several for a device count or 'auto'."""
    if isinstance(mesh, str):
        if mesh != "auto":
            raise MeshError(
                f"mesh={mesh!r}: the only string accepted is 'auto' (all local devices)"
            )
        mesh = len(jax.devices())
    if isinstance(mesh, int | np.integer) and not isinstance(mesh, bool):
        return [make_mesh(m) for m in mesh_candidates(int(mesh), devices_per_node)]
    return [make_mesh(mesh)]


def pipeline_meshes(n: int, devices_per_node: int, axis: str = "stage") -> list[dict[str, int]]:
    """Shapes to try for `pipeline_stages="auto"` on `n` devices: for every stage count
    S > 1 dividing `n`, `{axis: S, "data": d, "model": t}` with the tensor-parallel axis
    as large as fits in a node (`t` the largest divisor of n/S up to
    `devices_per_node`); and no pipeline, `{"data": d, "model": t}` with every such `t`
    (the best unpipelined plan's tensor axis is often narrower than a node: a trial's
    ViT-B/16 on 64 devices, data 16 x model 4). Axes of size 1 are left out."""
    out = []
    for stages in (s for s in range(1, n + 1) if n % s == 0):
        rest = n // stages
        widths = [d for d in range(1, min(rest, devices_per_node) + 1) if rest % d == 0]
        for t in widths if stages == 1 else widths[-1:]:
            shape = {axis: stages, "data": rest // t, "model": t}
            kept = {k: v for k, v in shape.items() if v > 1 or (k == axis and stages > 1)}
            if stages > 1 or tuple(kept.values()) not in [tuple(m.values()) for m in out]:
                out.append(kept)  # (one 1-D shape: `data` n and `model` n are one mesh)
    return [m or {"data": 1} for m in out]


def staged_meshes(n: int, stages: int, devices_per_node: int) -> list[dict[str, int]]:
    """Shapes to try for `pipeline_stages=stages` on a device count `n` (which `stages`
    divides): a 'stage' axis of that size, outermost (across nodes, where stages pass
    only activations), over each shape `mesh_candidates` gives the `n // stages`
    devices of a stage."""
    return [
        {"stage": stages, **{k: v for k, v in shape.items() if v > 1}}
        for shape in mesh_candidates(n // stages, devices_per_node)
    ]


def equivalent(a: MeshInfo, b: MeshInfo) -> bool:
    """Whether the cost model cannot tell meshes `a` and `b` apart: some relabeling of
    `a`'s axes as `b`'s keeps every axis size and, for every group of axes, whether its
    device groups stay inside one node (all the cost model reads of a mesh: shards,
    collective sizes, links). `{"data": 32, "model": 2, "expert": 4}` and `{"data": 32,
    "model": 4, "expert": 2}` on 8-device nodes are one mesh to it."""
    if len(a.axis_sizes) != len(b.axis_sizes) or math.prod(a.axis_sizes) != math.prod(b.axis_sizes):
        return False
    n = len(a.axis_sizes)
    groups = [s for r in range(1, n + 1) for s in itertools.combinations(range(n), r)]
    for perm in itertools.permutations(range(n)):
        if any(a.axis_sizes[i] != b.axis_sizes[perm[i]] for i in range(n)):
            continue
        if all(
            a.is_intra_node([a.axis_names[i] for i in s])
            == b.is_intra_node([b.axis_names[perm[i]] for i in s])
            for s in groups
        ):
            return True
    return False


def stage_meshes(mesh: Mesh, axis: str) -> list[Mesh]:
    """Per index of `axis`, the mesh of its devices with that axis dropped (a pipeline
    stage's sub-mesh, where a layer unrolled in Python keeps its leaves)."""
    k = mesh.axis_names.index(axis)
    names = tuple(a for a in mesh.axis_names if a != axis)
    types = tuple(t for a, t in zip(mesh.axis_names, mesh.axis_types) if a != axis)
    return [
        Mesh(np.take(mesh.devices, s, axis=k), names, axis_types=types)
        for s in range(mesh.devices.shape[k])
    ]
