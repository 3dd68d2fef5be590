"""A step's graph at another micro-batch size, derived from two traces instead of traced.

A pipeline try traces the step again at its micro-batch size (`compile.pipelines`). On
layers unrolled in Python that trace is JAX tracing every layer (~10 s for GPT-3
175B's 96), once per micro-batch size tried. Tracing is shape-driven, so the same
function at two batch sizes gives the same ops in the same order, and every shape and
shape-valued param that depends on the batch is proportional to it (a batch dim, a
reshape's `batch * seq`, a broadcast's target). Given the step traced at the whole
batch and once at one micro-batch size, `rescaled` writes it at any other: what
differs between the two traces is the batch's, and is divided by the other count.

That is an assumption about how the step computes its shapes, checked only at the two
traced sizes: one computed otherwise (`max(batch, 64)`) that happens to be proportional
at both would be derived wrong; hence a derived graph is only ever priced (below).

Where it visibly does not hold it says so (None) and the caller traces: the two traces
differ in their ops or in anything but integers (a constant's shape, a param that is
no int), or a differing integer is not the reference count's exact multiple, or not
divisible by the other count. A loop's `jaxpr` param is the one thing kept stale
(the whole batch's): a derived graph is priced and searched, never lowered or
evaluated (the plan's try is traced again at its size before it is made into the
program: `compile.pipelines.PipelineTries._realized`); a loop body with any such
param inside it is refused, since passes retrace bodies by evaluating their ops."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.ir.graph import Graph, TensorType

_STALE = ("jaxpr",)  # params of a top-level loop kept as they are (module doc)
# params that hold the mesh a trace was made under, not a shape (`sharding`,
# `out_sharding`): the micro-batch traces are made under the try's mesh (the whole
# batch's, under none where meshes are searched), so the reference's is the one at the
# other size too
_MESH = "sharding"


class _Differs(Exception):
    """The two traces differ in a way the batch does not explain."""


def rescaled(full: Graph, ref: Graph, ref_count: int, count: int) -> Graph | None:
    """`full` (the step at the whole batch) as it traces with the batch cut into `count`
    micro-batches, derived from `ref`, the same step traced with it cut into
    `ref_count` (module doc); None where the two traces do not allow it."""
    if ref_count <= 1 or count < 1:
        return None
    try:
        return _graph(full, ref, ref_count, count, top=True)
    except _Differs:
        return None


def _graph(full: Graph, ref: Graph, m0: int, m: int, top: bool) -> Graph:
    """`full` at `m` micro-batches from `ref` at `m0` (`top`: not a loop body)."""
    if (
        len(full.values) != len(ref.values)
        or len(full.nodes) != len(ref.nodes)
        or (full.inputs, full.outputs) != (ref.inputs, ref.outputs)
        or full.consts.keys() != ref.consts.keys()
    ):
        raise _Differs
    for v, c in full.consts.items():
        if getattr(c, "shape", None) != getattr(ref.consts[v], "shape", None):
            raise _Differs
    values = tuple(_type(a, b, m0, m) for a, b in zip(full.values, ref.values))
    nodes = []
    for a, b in zip(full.nodes, ref.nodes):
        if (a.op, a.inputs, a.outputs, a.params.keys()) != (
            b.op, b.inputs, b.outputs, b.params.keys()
        ):  # fmt: skip
            raise _Differs
        params = {
            k: _param(k, a.params[k], b.params[k], m0, m, top and a.body is not None)
            for k in a.params
        }
        body = _graph(a.body, b.body, m0, m, top=False) if a.body is not None else None
        if a.branches is not None:
            raise _Differs  # a cond's branches are bound by their `branches` param
        nodes.append(replace(a, params=params, body=body))
    return replace(full, values=values, nodes=tuple(nodes))


def _type(a: TensorType, b: TensorType, m0: int, m: int) -> TensorType:
    if (a.dtype, a.extended, len(a.shape)) != (b.dtype, b.extended, len(b.shape)):
        raise _Differs
    if a.shape == b.shape:
        return a
    return replace(a, shape=tuple(_int(x, y, m0, m) for x, y in zip(a.shape, b.shape)))


def _int(x: int, y: int, m0: int, m: int) -> int:
    """`x` at the whole batch, `y` at `m0` micro-batches: its value at `m`."""
    if x == y:
        return x
    if x != m0 * y or x % m:
        raise _Differs
    return x // m


def _param(key: str, a: Any, b: Any, m0: int, m: int, loop: bool) -> Any:
    if loop and key in _STALE:
        return a
    if _MESH in key:
        return b
    if a is b or _same(a, b):
        return a
    if isinstance(a, bool) or isinstance(b, bool):
        raise _Differs
    if isinstance(a, int) and isinstance(b, int):
        return _int(a, b, m0, m)
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_param(key, x, y, m0, m, False) for x, y in zip(a, b))
    raise _Differs


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a:  # NaN (a gather's fill value)
        return b != b
    if hasattr(a, "eqns") or hasattr(a, "jaxpr"):  # a (closed) jaxpr: equal by identity
        return str(a) == str(b)  # alone, so by what it computes (a scatter's `add`)
    try:
        return bool(a == b)
    except Exception:  # arrays and the like: compared by identity only
        return False
