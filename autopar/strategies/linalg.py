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
    Partial sum. Spatial dims stay whole (sharding them needs halo exchange)."""
    lhs, rhs = (graph.values[v] for v in node.inputs)
    out = graph.values[node.outputs[0]]
    dn = node.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    ld: list[int | None] = [None] * lhs.rank
    rd: list[int | None] = [None] * rhs.rank
    od: list[int | None] = [None] * out.rank
    factors = [Factor(lhs.shape[lhs_spec[0]], name="N")]
    grouped = node.params["feature_group_count"] != 1 or node.params["batch_group_count"] != 1
    if node.params["batch_group_count"] == 1:
        ld[lhs_spec[0]] = od[out_spec[0]] = 0
    if not grouped:
        factors += [
            Factor(rhs.shape[rhs_spec[0]], name="O"),
            Factor(lhs.shape[lhs_spec[1]], reduce=True, name="C"),
        ]
        rd[rhs_spec[0]] = od[out_spec[1]] = 1
        ld[lhs_spec[1]] = rd[rhs_spec[1]] = 2
    return FactorRule(tuple(factors), (tuple(ld), tuple(rd)), (tuple(od),))
