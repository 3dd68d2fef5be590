"""Ops that move or rearrange dims: broadcast, reshape, transpose, slicing, padding, tiling."""

from __future__ import annotations

import math

from autopar.ir.graph import Graph, Node
from autopar.strategies import Factor, FactorRule, register


def _types(node: Node, graph: Graph):
    return [graph.values[v] for v in node.inputs], [graph.values[v] for v in node.outputs]


@register("broadcast_in_dim")
def broadcast_rule(node: Node, graph: Graph) -> FactorRule:
    """Operand dim i lands on out dim broadcast_dimensions[i]; new dims shard freely."""
    (src, *rest), (out,) = _types(node, graph)
    bdims = node.params["broadcast_dimensions"]
    factors = tuple(Factor(s) for s in out.shape)
    in_dims = tuple(j if src.shape[i] == out.shape[j] else None for i, j in enumerate(bdims))
    return FactorRule(
        factors, (in_dims, *((None,) * t.rank for t in rest)), (tuple(range(out.rank)),)
    )


@register("reshape")
def reshape_rule(node: Node, graph: Graph) -> FactorRule:
    """In dim i and out dim j may share a split when the same number of elements
    precedes them (equal prefix products): splitting either into k blocks then
    cuts the same flat ranges. The split must divide both sizes."""
    (src, *rest), (out,) = _types(node, graph)
    in_prefix = [math.prod(src.shape[:i]) for i in range(src.rank)]
    out_prefix = {math.prod(out.shape[:j]): j for j in range(out.rank) if out.shape[j] > 1}
    factors: list[Factor] = []
    in_dims: list[int | None] = [None] * src.rank
    out_dims: list[int | None] = [None] * out.rank
    for i in range(src.rank):
        j = out_prefix.get(in_prefix[i])
        if j is not None and src.shape[i] > 1:
            in_dims[i] = out_dims[j] = len(factors)
            factors.append(Factor(math.gcd(src.shape[i], out.shape[j])))
    return FactorRule(
        tuple(factors), (tuple(in_dims), *((None,) * t.rank for t in rest)), (tuple(out_dims),)
    )


@register("squeeze")
def squeeze_rule(node: Node, graph: Graph) -> FactorRule:
    (src,), (out,) = _types(node, graph)
    dropped = {d % src.rank for d in node.params["dimensions"]}
    kept = [i for i in range(src.rank) if i not in dropped]
    factors = tuple(Factor(src.shape[i]) for i in kept)
    in_dims = tuple(kept.index(i) if i in kept else None for i in range(src.rank))
    return FactorRule(factors, (in_dims,), (tuple(range(len(kept))),))


@register("transpose")
def transpose_rule(node: Node, graph: Graph) -> FactorRule:
    (src,), _ = _types(node, graph)
    perm = node.params["permutation"]
    return FactorRule(
        tuple(Factor(s) for s in src.shape), (tuple(range(src.rank)),), (tuple(perm),)
    )


def _whole_dims_rule(node: Node, graph: Graph, whole: list[bool]) -> FactorRule:
    """Shape-preserving op on input 0 where only dims flagged `whole` may shard."""
    (src, *rest), outs = _types(node, graph)
    factors = tuple(Factor(s) for s in src.shape)
    dims = tuple(i if w else None for i, w in enumerate(whole))
    return FactorRule(factors, (dims, *((None,) * t.rank for t in rest)), tuple(dims for _ in outs))


@register("slice")
def slice_rule(node: Node, graph: Graph) -> FactorRule:
    (src,), _ = _types(node, graph)
    p = node.params
    strides = p["strides"] or (1,) * src.rank
    whole = [
        p["start_indices"][i] == 0 and p["limit_indices"][i] == src.shape[i] and strides[i] == 1
        for i in range(src.rank)
    ]
    return _whole_dims_rule(node, graph, whole)


@register("pad")
def pad_rule(node: Node, graph: Graph) -> FactorRule:
    (src, _), _ = _types(node, graph)
    whole = [tuple(c) == (0, 0, 0) for c in node.params["padding_config"]]
    return _whole_dims_rule(node, graph, whole)


@register("rev")
def rev_rule(node: Node, graph: Graph) -> FactorRule:
    (src,), _ = _types(node, graph)
    whole = [i not in node.params["dimensions"] for i in range(src.rank)]
    return _whole_dims_rule(node, graph, whole)


@register("dynamic_slice")
def dynamic_slice_rule(node: Node, graph: Graph) -> FactorRule:
    src = graph.values[node.inputs[0]]
    whole = [s == src.shape[i] for i, s in enumerate(node.params["slice_sizes"])]
    return _whole_dims_rule(node, graph, whole)


@register("dynamic_update_slice")
def dynamic_update_slice_rule(node: Node, graph: Graph) -> FactorRule:
    (src, upd, *idx), _ = _types(node, graph)
    factors = tuple(Factor(s) for s in src.shape)
    dims = tuple(i if upd.shape[i] == src.shape[i] else None for i in range(src.rank))
    return FactorRule(factors, (dims, dims, *((),) * len(idx)), (dims,))


@register("concatenate")
def concatenate_rule(node: Node, graph: Graph) -> FactorRule:
    ins, (out,) = _types(node, graph)
    axis = node.params["dimension"]
    factors = tuple(Factor(s) for s in out.shape)
    dims = tuple(None if i == axis else i for i in range(out.rank))
    return FactorRule(factors, tuple(dims for _ in ins), (dims,))


@register("stack")
def stack_rule(node: Node, graph: Graph) -> FactorRule:
    """`jnp.stack`: the operands' dims land on the result's around the new one, split
    alike; the new dim (one entry per operand) stays whole, as `concatenate`'s axis."""
    ins, (out,) = _types(node, graph)
    axis = node.params["axis"] % out.rank
    factors = tuple(Factor(s) for s in out.shape)
    in_dims = tuple(i if i < axis else i + 1 for i in range(out.rank - 1))
    out_dims = tuple(None if j == axis else j for j in range(out.rank))
    return FactorRule(factors, tuple(in_dims for _ in ins), (out_dims,))


@register("unstack")
def unstack_rule(node: Node, graph: Graph) -> FactorRule:
    """`jnp.unstack` (`stack`'s transpose): the operand's dims but `axis` land on every
    result's, split alike; `axis` stays whole."""
    (src,), outs = _types(node, graph)
    axis = node.params["axis"] % src.rank
    factors = tuple(Factor(s) for s in src.shape)
    in_dims = tuple(None if i == axis else i for i in range(src.rank))
    out_dims = tuple(k if k < axis else k + 1 for k in range(src.rank - 1))
    return FactorRule(factors, (in_dims,), tuple(out_dims for _ in outs))


@register("split")
def split_rule(node: Node, graph: Graph) -> FactorRule:
    (src,), outs = _types(node, graph)
    axis = node.params["axis"]
    factors = tuple(Factor(s) for s in src.shape)
    dims = tuple(None if i == axis else i for i in range(src.rank))
    return FactorRule(factors, (dims,), tuple(dims for _ in outs))


@register("tile")
def tile_rule(node: Node, graph: Graph) -> FactorRule:
    """`lax.tile(x, reps)`: out dim i is `reps[i]` copies of x's dim i back to back. A dim
    with `reps[i] == 1` is x's dim, sharded alike. A repeated dim may still be split on the
    output, with x whole along it (as a broadcast's new dim): each device tiles its
    block from the full x (a block of copies does not line up with one block of x)."""
    (src,), (out,) = _types(node, graph)
    reps = node.params["reps"]
    factors = tuple(Factor(s) for s in out.shape)
    in_dims = tuple(i if r == 1 else None for i, r in enumerate(reps))
    return FactorRule(factors, (in_dims,), (tuple(range(out.rank)),))


@register("iota", "empty", "empty2")  # empty2: the placeholder residuals of a cond's jvp
def iota_rule(node: Node, graph: Graph) -> FactorRule:
    """A value made from nothing: any layout, made in place."""
    _, (out,) = _types(node, graph)
    return FactorRule(tuple(Factor(s) for s in out.shape), (), (tuple(range(out.rank)),))


@register("expand_dims")
def expand_dims_rule(node: Node, graph: Graph) -> FactorRule:
    return reshape_rule(node, graph)
