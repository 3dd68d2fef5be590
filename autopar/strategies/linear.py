"""Partial sums that flow through linear ops instead of being summed first.

A Partial value (each device holds a summand) can go through any op that is
linear in it without communicating: `sum(convert(x_i)) = convert(sum(x_i))`, a
reduce_sum of summands is a summand of the reduce_sum, `a_i * w` for `w` the
same on every device, and so on. Summing late is how a Megatron MLP whose loss is
`sum(x @ W1 @ W2)` gets away with one 4-byte all-reduce instead of an all-reduce
of the whole activation.

`partial_variants` adds, to the strategies of such an op, copies in which the
linear operands and every output are Partial over a set of mesh axes the
strategy leaves unused. The variant marks those axes `PARTIAL` in its
`assignment`, so engines that move one axis at a time see them as a choice for
that axis like any factor.

`LOCAL_OPS` is where the jit lowering may run the op on per-device summands
(inside `shard_map`): these ops plus the contractions whose sharded reduction
makes a sum (reduce_max's Partial is a max, so it is never run that way).
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np

from autopar.ir.graph import Graph, Node
from autopar.ir.ops import CONTRACTIONS
from autopar.sharding import MeshInfo, Spec

PARTIAL = -1  # `Strategy.assignment` entry: the axis carries a passed-through partial sum

_UNARY = (
    "neg",
    "copy",
    "copy_p",
    "reshard",  # on Auto axes, an identity (`strategies.control.reshard_rule`)
    "reduce_sum",
    "transpose",
    "squeeze",
    "broadcast_in_dim",
    "reshape",
    "convert_element_type",
)
# primitive -> the groups of operands that may carry the partial sum (together)
LINEAR: dict[str, tuple[tuple[int, ...], ...]] = {
    **{op: ((0,),) for op in _UNARY},
    "add": ((0, 1),),
    "sub": ((0, 1),),
    "add_any": ((0, 1),),
    "mul": ((0,), (1,)),
    "div": ((0,),),
}
LOCAL_OPS = frozenset(LINEAR) | CONTRACTIONS | {"pad"}


def _linear_groups(node: Node, graph: Graph) -> tuple[tuple[int, ...], ...]:
    if node.op == "pad":  # with zeros: the transpose of a slice (`w[k]`'s gradient)
        fill = graph.consts.get(node.inputs[1])
        return ((0,),) if fill is not None and not np.any(np.asarray(fill)) else ()
    groups = LINEAR.get(node.op, ())
    out = graph.values[node.outputs[0]]
    if node.op == "convert_element_type":
        src = graph.values[node.inputs[0]]
        if not (
            jnp.issubdtype(src.dtype, jnp.floating) and jnp.issubdtype(out.dtype, jnp.floating)
        ):
            return ()
    if node.op in _UNARY:
        return groups
    # Per device, an operand broadcast implicitly (size-1 dims, replicated by the
    # elementwise rule) would not line up with a split one: only same-shape operands,
    # or scalars that are not the partial one.
    shapes = [graph.values[v].shape for v in node.inputs]
    if any(s not in (out.shape, ()) for s in shapes):
        return ()
    return tuple(grp for grp in groups if all(shapes[j] == out.shape for j in grp))


def partial_variants(node: Node, graph: Graph, mesh: MeshInfo, strategies: list) -> list:
    """Strategies in which a linear op passes partial sums through (see module doc)."""
    from autopar.strategies import Strategy

    groups = _linear_groups(node, graph)
    if not groups or any(graph.values[v].size == 0 for v in (*node.inputs, *node.outputs)):
        return []  # (shard_map cannot run per device on empty arrays)
    out = []
    names = mesh.axis_names
    for st in strategies:
        if any(s.partial for s in st.in_specs):
            continue
        used = {a for s in (*st.in_specs, *st.out_specs) for a in (*s.used_axes, *s.partial)}
        free = [a for a in names if a not in used and mesh.size(a) > 1]  # size 1: no sum
        for r in range(1, len(free) + 1):
            for axes in itertools.combinations(free, r):
                for grp in groups:
                    ins = tuple(
                        Spec(s.dims, axes) if j in grp else s for j, s in enumerate(st.in_specs)
                    )
                    outs = tuple(
                        Spec(s.dims, tuple(a for a in names if a in axes or a in s.partial))
                        for s in st.out_specs
                    )
                    assignment = tuple(
                        PARTIAL if a in axes else f for a, f in zip(names, st.assignment)
                    )
                    out.append(Strategy(ins, outs, assignment, st.parallel))
    return out
