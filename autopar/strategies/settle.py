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
    the spec its uses want (`settle_spec`). A partial sum cannot
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
        if partial.isdisjoint(node.inputs):
            continue
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
                out[v] = settle_spec(sp, wants[v])
    return out


def settle_spec(made: Spec, wants: Counter[Spec]) -> Spec:
    """The spec a value made partial (`made`) is summed into, given the specs its uses
    want (each distinct reader and spec once, then each function output): `made` itself
    when a use takes the same partial sum; else the one wanted spec every other wanted
    spec is a local slice of (`slices_to`), when there is one: a gradient the clip's
    norm reads split and its scaling reads whole is all-reduced once and sliced, where
    a reduce-scatter into the split layout would need an all-gather for the whole one
    (a latency more, and as many bytes again); else the spec most uses want (the first
    such use on a tie)."""
    if made in wants:
        return made
    for c in wants:
        if not c.partial and all(slices_to(c, w.without_partial()) for w in wants):
            return c
    return wants.most_common(1)[0][0]


def slices_to(a: Spec, b: Spec) -> bool:
    """Whether dense `b` is a local slice of dense `a`: on every dim, `a`'s axes lead
    `b`'s (the cost model's reshard adds such axes for free)."""
    return all(db[: len(da)] == da for da, db in zip(a.dims, b.dims))
