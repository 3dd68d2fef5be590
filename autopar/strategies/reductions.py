"""Reductions and scans along an axis."""

from __future__ import annotations

from autopar.ir.graph import Graph, Node
from autopar.strategies import Factor, FactorRule, register


def _reduce(node: Node, graph: Graph, shardable_reduction: bool) -> FactorRule:
    src = graph.values[node.inputs[0]]
    axes = set(node.params["axes"])
    factors, in_dims, out_dims = [], [], []
    for i, s in enumerate(src.shape):
        if i in axes:
            if shardable_reduction:
                in_dims.append(len(factors))
                factors.append(Factor(s, reduce=True, name="r"))
            else:
                in_dims.append(None)
        else:
            in_dims.append(len(factors))
            out_dims.append(len(factors))
            factors.append(Factor(s))
    outs = tuple(tuple(out_dims) for _ in node.outputs)
    return FactorRule(tuple(factors), tuple(tuple(in_dims) for _ in node.inputs), outs)


@register(
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor"
)
def reduce_rule(node: Node, graph: Graph) -> FactorRule:
    """Sharding a reduced axis leaves a Partial result (sum, or max/min for those ops)."""
    return _reduce(node, graph, shardable_reduction=True)


@register("argmax", "argmin")
def arg_reduce_rule(node: Node, graph: Graph) -> FactorRule:
    """Indices cannot be combined by a sum: the reduced axis stays whole."""
    return _reduce(node, graph, shardable_reduction=False)


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative_rule(node: Node, graph: Graph) -> FactorRule:
    t = graph.values[node.inputs[0]]
    axis = node.params["axis"]
    factors = tuple(Factor(s) for s in t.shape)
    dims = tuple(None if i == axis else i for i in range(t.rank))
    return FactorRule(factors, (dims,), (dims,))


@register("sort")
def sort_rule(node: Node, graph: Graph) -> FactorRule:
    t = graph.values[node.inputs[0]]
    axis = node.params["dimension"]
    dims = tuple(None if i == axis else i for i in range(t.rank))
    return FactorRule(
        tuple(Factor(s) for s in t.shape), (dims,) * len(node.inputs), (dims,) * len(node.outputs)
    )


@register("top_k")
def top_k_rule(node: Node, graph: Graph) -> FactorRule:
    t = graph.values[node.inputs[0]]
    dims = tuple(range(t.rank - 1)) + (None,)
    return FactorRule(tuple(Factor(s) for s in t.shape), (dims,), (dims,) * len(node.outputs))


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
def reduce_window_rule(node: Node, graph: Graph) -> FactorRule:
    """Pooling: only dims with a trivial window (size 1, stride 1, no padding) shard."""
    t = graph.values[node.inputs[0]]
    p = node.params
    dims = tuple(
        i
        if p["window_dimensions"][i] == 1
        and p["window_strides"][i] == 1
        and tuple(p["padding"][i]) == (0, 0)
        and (not p.get("base_dilation") or p["base_dilation"][i] == 1)
        else None
        for i in range(t.rank)
    )
    factors = tuple(Factor(s) for s in t.shape)
    return FactorRule(
        factors,
        tuple(
            dims if graph.values[v].rank == t.rank else (None,) * graph.values[v].rank
            for v in node.inputs
        ),
        (dims,) * len(node.outputs),
    )


@register("select_and_scatter_add", "select_and_gather_add")
def select_and_scatter_rule(node: Node, graph: Graph) -> FactorRule:
    """Max-pool gradients: same trivial-window condition as pooling."""
    p = node.params
    t = graph.values[node.outputs[0]]
    pads = p["padding"]
    dims = tuple(
        i
        if p["window_dimensions"][i] == 1
        and p["window_strides"][i] == 1
        and tuple(pads[i]) == (0, 0)
        else None
        for i in range(t.rank)
    )
    factors = tuple(Factor(s) for s in t.shape)

    def d(v):
        r = graph.values[v]
        return (
            tuple(x if r.shape[i] == t.shape[i] else None for i, x in enumerate(dims))
            if r.rank == t.rank
            else (None,) * r.rank
        )

    return FactorRule(factors, tuple(d(v) for v in node.inputs), (dims,))
