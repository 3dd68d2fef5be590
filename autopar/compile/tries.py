"""A call's (mesh, pipeline) tries searched side by side, ahead of the driver's walk.

`compile.driver._Driver._search` walks the tries cheapest floor first and leaves out a
try that the best price found so far rules out (its FLOP floor on an abstract mesh, its
screen price past the margin). `ahead` searches the tries at once in forked workers
(`search.workers`), in the walk's order, and leaves out at a try's turn only what the
walk is sure to leave out: it replays the walk over the tries before it as far as their
results are in; the best price of that replayed prefix is at or above the walk's best
when it reaches the try (a best only falls), and both rules leave out more under a
lower best. The walk then takes the workers' results in its own order and makes the
same decisions, notes and plan as it would alone. A result comes back without its
problem (a problem does not pickle); the driver builds the problem of a plan it makes
again."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from autopar.compile.clock import try_name
from autopar.ir.graph import Graph
from autopar.search import workers
from autopar.search.result import SearchResult

log = logging.getLogger("autopar")


def ahead(
    graph: Graph,
    tries: list,
    order: list[int],
    one: Callable[[int, int], Any],
    pruned: Callable[[int, float], bool],
    clock: Any,
) -> dict[int, Any]:
    """{try index: `one(step, i)` without its problem} for the tries searched side by
    side; {} where `search.workers` gives one worker, or where the tries are not
    pipelined and the graph outside their loops is big enough for the engines of each
    try to run side by side (one level of workers: the engines where a try's problem
    is big, the tries where only their loop bodies are or where each builds a
    pipeline). `pruned(i, best)`: whether
    the walk leaves try `i` out once `best` is the best price found."""
    # a try builds its problem and runs `auto`'s four searches on it (and on its loop
    # bodies): that much work per try is what `search.workers`' threshold weighs
    n = workers.usable(4 * size(graph), len(order))
    # Pipelined tries go side by side whatever their size: building one searches its
    # loop bodies (a nested search per try), which engines side by side would leave to
    # this process alone (a 24-layer GPT-3-wide step unrolled in Python: 48 s of such
    # builds here against 61 s of engines side by side).
    pipelined = any(p is not None for _, _, p in tries)
    if n <= 1 or (workers.usable(len(graph.nodes), 2) > 1 and not pipelined):
        return {}  # (the latter: each try's engines run side by side instead)
    position = {i: p for p, i in enumerate(order)}

    def skip(i: int, done: dict[int, Any]) -> bool:
        best = math.inf  # the walk's, over the tries before `i` whose results are in
        for j in order[: position[i]]:
            if pruned(j, best):
                continue  # left out by the walk too (a try skipped here is, by induction)
            if j not in done:
                break  # still searching: the walk's best from here on is at most `best`
            best = min(best, _price(done[j]))
        return pruned(i, best)

    def task(step: int, i: int) -> Callable[[], Any]:
        def run() -> Any:
            got = one(step, i)
            return got if isinstance(got, str) else (None, *got[1:])

        return run

    log.info("searching %d mesh/pipeline tries side by side (%d workers)", len(order), n)
    return workers.run_all(
        {i: task(step, i) for step, i in enumerate(order)},
        n,
        clock,
        enough=lambda done: any(math.isfinite(_price(r)) for r in done.values()),
        phase="tries",
        skip=skip,
        label=lambda i: try_name(
            dict(zip(tries[i][1].axis_names, tries[i][1].axis_sizes)), tries[i][2]
        ),
    )


def _price(got: Any) -> float:
    """The best price of a try's result, its other schedule's included (inf: none, or
    no plan)."""
    if isinstance(got, str) or not isinstance(got[1], SearchResult):
        return math.inf
    return min((cost.step_s for _, _, cost in (*got[1].ranked, *got[2])), default=math.inf)


def size(graph: Graph) -> int:
    """Ops in `graph`, its loop bodies and branches included (what a try searches)."""
    return sum(
        1 + (size(n.body) if n.body is not None else 0) + sum(size(b) for b in n.branches or ())
        for n in graph.nodes
    )
