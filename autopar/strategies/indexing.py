"""Gather and scatter: the embedding lookup and its scatter-add gradient."""

from __future__ import annotations

from autopar.ir.graph import Graph, Node
from autopar.strategies import Factor, FactorRule, register


@register("gather")
def gather_rule(node: Node, graph: Graph) -> FactorRule:
    """Index batch dims shard output and indices alike (and the operand's batching
    dims); whole-slice operand dims shard with their output offset dims; an
    indexed operand dim (vocab-parallel embedding) leaves a Partial sum."""
    operand, indices = (graph.values[v] for v in node.inputs)
    out = graph.values[node.outputs[0]]
    dn = node.params["dimension_numbers"]
    slice_sizes = node.params["slice_sizes"]
    factors: list[Factor] = []
    od: list[int | None] = [None] * out.rank
    opd: list[int | None] = [None] * operand.rank
    idd: list[int | None] = [None] * indices.rank
    batch_out = [d for d in range(out.rank) if d not in dn.offset_dims]
    for t in range(indices.rank - 1):
        idd[t] = od[batch_out[t]] = len(factors)
        if t in dn.start_indices_batching_dims:
            opd[dn.operand_batching_dims[dn.start_indices_batching_dims.index(t)]] = len(factors)
        factors.append(Factor(indices.shape[t], name="i"))
    offset_operand = [
        d
        for d in range(operand.rank)
        if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims
    ]
    for d, o in zip(offset_operand, dn.offset_dims):
        if slice_sizes[d] == operand.shape[d] and d not in dn.start_index_map:
            opd[d] = od[o] = len(factors)
            factors.append(Factor(operand.shape[d], name="o"))
    for d in dn.collapsed_slice_dims:
        if d in dn.start_index_map and slice_sizes[d] == 1:
            opd[d] = len(factors)
            factors.append(Factor(operand.shape[d], reduce=True, name="v"))
    return FactorRule(tuple(factors), (tuple(opd), tuple(idd)), (tuple(od),))


@register("scatter-add", "scatter_add", "scatter")
def scatter_rule(node: Node, graph: Graph) -> FactorRule:
    """Scatter dims of the updates: Partial output for scatter-add (each device adds
    its updates), never sharded for an overwriting scatter. Window dims shard with
    the operand; an indexed operand dim shards operand and output only."""
    operand, indices, updates = (graph.values[v] for v in node.inputs[:3])
    dn = node.params["dimension_numbers"]
    is_add = node.op != "scatter"
    factors: list[Factor] = []
    opd: list[int | None] = [None] * operand.rank
    idd: list[int | None] = [None] * indices.rank
    upd: list[int | None] = [None] * updates.rank
    scatter_upd = [d for d in range(updates.rank) if d not in dn.update_window_dims]
    for t in range(indices.rank - 1):
        batching = t in dn.scatter_indices_batching_dims
        if not (batching or is_add):
            continue
        idd[t] = upd[scatter_upd[t]] = len(factors)
        if batching:
            opd[dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(t)]] = len(factors)
        factors.append(Factor(indices.shape[t], reduce=not batching, name="i"))
    window_operand = [
        d
        for d in range(operand.rank)
        if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
    ]
    for d, u in zip(window_operand, dn.update_window_dims):
        if updates.shape[u] == operand.shape[d]:
            opd[d] = upd[u] = len(factors)
            factors.append(Factor(operand.shape[d], name="o"))
    if is_add:
        for d in dn.inserted_window_dims:
            if d in dn.scatter_dims_to_operand_dims:
                opd[d] = len(factors)
                factors.append(Factor(operand.shape[d], name="v"))
    return FactorRule(tuple(factors), (tuple(opd), tuple(idd), tuple(upd)), (tuple(opd),))
