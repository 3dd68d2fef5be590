"""Where partial sums are settled: shared by the evaluator's memory model and the
lowering, so both agree on which values stay partial."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from autopar.ir.graph import Graph
from autopar.sharding import Spec


def settle_partials(
    graph: Graph,
    op_in_specs: Sequence[Sequence[Spec]],
    op_out_specs: Sequence[Sequence[Spec]],
    output_specs: Sequence[Spec],
) -> dict[int, Spec]:
    """Where the lowering sums each partial value: right where it is produced, into
    the spec most of its uses want (the first such use on a tie). A partial sum cannot
    be written as a sharding constraint, and left unconstrained XLA may partition the
    producing contraction its own way; summing at once also frees the full-size
    partial (e.g. a weight gradient before its reduce-scatter). A value some use takes
    as the same partial sum (a linear op passing it through) stays partial: its
    settled spec is its own. value id -> spec."""
    partial = {
        v
        for node, specs in zip(graph.nodes, op_out_specs)
        for v, sp in zip(node.outputs, specs)
        if sp.partial
    }
    wants: dict[int, Counter[Spec]] = {}
    for node, specs in zip(graph.nodes, op_in_specs):
        # a value an op reads twice in one spec counts once (x * x)
        for v, sp in dict.fromkeys(zip(node.inputs, specs)):
            if v in partial:
                wants.setdefault(v, Counter())[sp] += 1
    for v, sp in zip(graph.outputs, output_specs):
        if v in partial:
            wants.setdefault(v, Counter())[sp] += 1
    out: dict[int, Spec] = {}
    for node, specs in zip(graph.nodes, op_out_specs):
        for v, sp in zip(node.outputs, specs):
            if sp.partial and wants.get(v):
                out[v] = sp if sp in wants[v] else wants[v].most_common(1)[0][0]
    return out
