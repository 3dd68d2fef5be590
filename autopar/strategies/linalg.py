"""Contractions: dot_general and conv_general_dilated."""

from __future__ import annotations

import string

from autopar.ir.graph import Graph, Node
from autopar.strategies import Factor, FactorRule, register


@register("dot_general")
def dot_general_rule(node: Node, graph: Graph) -> FactorRule:
    """`b m k, b k n -> b m n`: batch and free dims shard freely, `k` leaves a Partial sum.
    Written as the einsum of the dimension numbers: batch dims, then the free dims of
    each operand in order, then the contracting ones, each a fresh letter."""
    lhs, rhs = (graph.values[v] for v in node.inputs)
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    letters = iter(string.ascii_letters)
    ls, rs = [""] * lhs.rank, [""] * rhs.rank
    out = []
    for a, b in zip(lb, rb):
        ls[a] = rs[b] = next(letters)
        out.append(ls[a])
    for term, used in ((ls, {*lc, *lb}), (rs, {*rc, *rb})):
        for i in range(len(term)):
            if i not in used:
                term[i] = next(letters)
                out.append(term[i])
    for a, b in zip(lc, rc):  # fresh letters in order: numbered in this order
        ls[a] = rs[b] = next(letters)
    spec = f"{''.join(ls)},{''.join(rs)}->{''.join(out)}"
    return FactorRule.einsum(spec, lhs.shape, rhs.shape)


@register("conv_general_dilated")
def conv_rule(node: Node, graph: Graph) -> FactorRule:
    """Batch `N` and output features `O` shard freely; input features `C` leave a
    Partial sum. Spatial dims stay whole (sharding them needs halo exchange).

    Grouped convolutions (XLA's groups are contiguous, group-major blocks of a dim):
    with `feature_group_count` G, the groups `G` shard input features, kernel outputs
    and output features together (each device convolves its own groups: a depthwise
    conv splits its channels), and `N` shards; a group's input features do not split.
    With `batch_group_count` B (the kernel gradient of a grouped conv: JAX gives the
    forward's channels the batch role and contracts over the forward's batch), the
    contracted features `C` leave a Partial sum as usual (the gradient of a batch-split
    depthwise conv is a sum over devices, as data parallelism has it), and the groups
    shard the lhs batch, the kernel outputs and the output features together where
    each group is one row (B = lhs batch = output features, the depthwise case)."""
    lhs, rhs = (graph.values[v] for v in node.inputs)
    out = graph.values[node.outputs[0]]
    dn = node.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    ld: list[int | None] = [None] * lhs.rank
    rd: list[int | None] = [None] * rhs.rank
    od: list[int | None] = [None] * out.rank
    G, B = node.params["feature_group_count"], node.params["batch_group_count"]
    factors: list[Factor] = []

    def factor(f: Factor, *at: tuple[list, int]) -> None:
        for dims, d in at:
            dims[d] = len(factors)
        factors.append(f)

    if B == 1:
        factor(Factor(lhs.shape[lhs_spec[0]], name="N"), (ld, lhs_spec[0]), (od, out_spec[0]))
    if G == 1 and B == 1:
        factor(Factor(rhs.shape[rhs_spec[0]], name="O"), (rd, rhs_spec[0]), (od, out_spec[1]))
    if G > 1:
        factor(Factor(G, name="G"), (ld, lhs_spec[1]), (rd, rhs_spec[0]), (od, out_spec[1]))
    if G == 1:
        factor(
            Factor(lhs.shape[lhs_spec[1]], reduce=True, name="C"),
            (ld, lhs_spec[1]),
            (rd, rhs_spec[1]),
        )
    if B > 1 and lhs.shape[lhs_spec[0]] == B == out.shape[out_spec[1]]:
        factor(Factor(B, name="G"), (ld, lhs_spec[0]), (rd, rhs_spec[0]), (od, out_spec[1]))
    return FactorRule(tuple(factors), (tuple(ld), tuple(rd)), (tuple(od),))
