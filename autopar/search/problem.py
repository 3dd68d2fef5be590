"""The search problem of a function, its scan bodies and cond branches searched.

`Problem` and the pricing live in `search.build`, whose `build_problem` takes the
search of nested graphs as a hook (`NestedSearch`); this module passes the driver's
(`search.nested.search_nested`) by default, so callers build a problem without it.
It sits above the driver and the engines, which import `search.build` instead."""

from __future__ import annotations

from autopar.cost.model import CostModel
from autopar.ir.graph import Graph
from autopar.passes.pipeline import PipelinedScans
from autopar.search import build
from autopar.search.build import (
    Branches,
    NestedSearch,
    Problem,
    batch_like_body_inputs,
    find_aliases,
    input_strategies,
    residency,
    step_floor,
)
from autopar.search.facts import graph_flops
from autopar.search.nested import search_nested
from autopar.sharding import MeshInfo

__all__ = [
    "Branches",
    "NestedSearch",
    "Problem",
    "batch_like_body_inputs",
    "build_problem",
    "find_aliases",
    "graph_flops",
    "input_strategies",
    "residency",
    "step_floor",
]


def build_problem(
    graph: Graph,
    mesh: MeshInfo,
    cost: CostModel,
    pipelined: PipelinedScans | None = None,
    partial_carry: bool = False,
    partial_outputs: frozenset[int] = frozenset(),
    nested: NestedSearch = search_nested,
) -> Problem:
    """`search.build.build_problem`, scan bodies and cond branches searched by
    `nested` (by default the driver, `search.nested`)."""
    return build.build_problem(
        graph, mesh, cost, pipelined, partial_carry, partial_outputs, nested=nested
    )
