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
from dataclasses import dataclass, field
from typing import Any

from autopar.compile.calls import pipeline_of
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
            dict(zip(tries[i][1].axis_names, tries[i][1].axis_sizes)), pipeline_of(tries[i][2])
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


# Engines whose search is `dp`'s (much longer than `recursive`'s): started first in a
# pool of several tries' first searches, so the longest tasks do not come last.
_LONG = ("dp", "data", "fsdp", "ilp")


def firsts_ahead(
    order: list[int],
    screen: dict[int, float],
    built: dict[int, Any],
    pruned: Callable[[int, float], bool],
    budget: float,
    clock: Any,
    nodes: int,
    build: Callable[[int], Any],
    tasks_of: Callable[[Any], dict[str, Callable[[], Any]]],
    name: Callable[[int], str],
) -> dict[int, dict[str, Any]]:
    """{try: its first searches' results} (`search.first_tasks`, for `search(...,
    first=)`) for the screened tries worth a full search, searched side by side in one
    pool of workers, not one try's engines after another's: a try whose `dp` is its
    longest search no longer leaves a worker idle at its end, and this process builds
    the problems of the tries missing from `built` (it puts them there) while the
    workers search the others. A try's tasks are left out at their turn if the walk is
    sure to leave the try out (`ahead`'s replay); a try is in the result only with all
    its tasks (else, at the time limit, the walk searches it as it would alone).

    The tries are those of `order` (the walk's) whose `screen` price is within the
    margin of the best one's (not `pruned` at that price: the walk searches them unless
    a full search's plan lowers the bound); {} where fewer than two are, or where the
    graph's `nodes` are searched inline."""
    prices = [p for p in screen.values() if math.isfinite(p)]
    kept = [
        i
        for i in order
        if math.isfinite(screen.get(i, math.nan)) and not pruned(i, min(prices, default=0))
    ]
    n = workers.usable(nodes, 4 * len(kept))
    if len(kept) < 2 or n < 2:
        return {}
    keys: dict[int, list[str]] = {}

    def tasks(i: int) -> dict[tuple[int, str], Callable[[], Any]]:
        got = tasks_of(built[i])
        keys[i] = sorted(got, key=lambda k: (k.split("+")[0] not in _LONG, list(got).index(k)))
        return {(i, k): got[k] for k in keys[i]}

    def beside() -> dict:
        more = {}
        for i in kept:
            if i not in built:
                built[i] = build(i)
                more.update(tasks(i))
        return more

    def price(i: int, done: dict) -> float:
        costs = [done[(i, k)][0][1] for k in keys[i]]
        return min((c.step_s for c in costs if c.peak_memory_bytes <= budget), default=math.inf)

    def skip(key: tuple[int, str], done: dict) -> bool:
        best = math.inf  # the walk's, over the kept tries before this one
        for j in kept[: kept.index(key[0])]:
            if pruned(j, best):
                continue
            if j not in keys or any((j, k) not in done for k in keys[j]):
                break
            best = min(best, price(j, done))
        return pruned(key[0], best)

    pool = {}
    for i in kept:
        if i in built:
            pool.update(tasks(i))
    log.info("searching %d mesh shapes' engines side by side (%d workers)", len(kept), n)
    done = workers.run_all(
        pool,
        n,
        clock,
        enough=lambda got: any(r[0][1].peak_memory_bytes <= budget for r in got.values()),
        skip=skip,
        label=lambda key: f"{key[1]} on {name(key[0])}",
        beside=beside,
    )
    return {
        i: {k: done[(i, k)] for k in keys[i]}
        for i in keys
        if keys[i] and all((i, k) in done for k in keys[i])
    }


def try_key(entry: tuple) -> tuple:
    """A (mesh index, mesh, pipeline) try as the same try under every remat policy."""
    k, _, pipelined = entry
    pipe = pipeline_of(pipelined)
    return (k, type(pipelined).__name__, None if pipe is None else pipe.pipe)


@dataclass
class Earlier:
    """What `remat="auto"`'s earlier policies found, for the later ones (each recomputes
    what the one before does and more): the best price of their plans, and per try what
    bounds its price under a later policy from below: its fastest plan of any memory
    (`bound`) plus the FLOPs the later policy recomputes on top, at the profile's FLOP
    rate (the difference of the two policies' FLOP floors, `search.problem.step_floor`).
    A later policy leaves out a try whose bound is at or above that best."""

    best: float = math.inf
    # `try_key` -> (fastest plan's seconds, the try's FLOP floor, the policy) of the try
    # under the policy that bounds it highest
    tries: dict[tuple, tuple[float, float, str]] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)  # policy -> what it left out

    def settled(self, tries: list, floors: list[float], policy: str) -> set[int]:
        """The indices of the `tries` `policy` leaves out (`floors`: their FLOP floors
        under it)."""
        out = set()
        for i, entry in enumerate(tries):
            fastest, before, _ = self.tries.get(try_key(entry), (0.0, math.inf, ""))
            if fastest + max(floors[i] - before, 0.0) >= self.best:
                out.add(i)
        if out:
            self.left[policy] = f"{len(out)} of {len(tries)} tries ruled out unsearched"
        return out

    def add(self, entry: tuple, fastest: float, floor: float, policy: str) -> None:
        """Try `entry` searched under `policy`: its `fastest` plan (`bound`) and FLOP
        `floor` (the highest bound is kept)."""
        if fastest > self.tries.get(try_key(entry), (0.0,))[0]:
            self.tries[try_key(entry)] = (fastest, floor, policy)

    def note(self, settled: set[int], tries: list, policy: str | None) -> str:
        """The plan note on the `settled` tries `policy` left out."""
        under = sorted({self.tries[try_key(tries[i])][2] for i in settled})
        return (
            f"{len(settled)} of {len(tries)} (mesh, pipeline) tries not searched under "
            f"remat={policy}: under remat={'/'.join(under)} their fastest plans, over the "
            f"memory budget or not, with what remat={policy} recomputes on top at the FLOP "
            f"rate, already take {self.best * 1e3:.4g} ms or more"
        )


def bound(result, other, pipe) -> float:
    """A try's fastest plan of any memory: of its search's candidates (those over the
    budget included; where none fit, the fastest the error records) and the plans
    repriced under ZB-H1 (`other`). Where the try is repriced so (`pipe`: its ZB-H1
    form, `_rescheduling`), the candidates less the 1F1B bubble (the ZB-H1 form of one
    over the budget was not priced; it is at most that much faster). 0: no plan."""
    if isinstance(result, SearchResult):
        costs = [c.step_s for c in result.candidates.values()]
    else:  # (an Infeasible)
        costs = [getattr(result.error, "fastest", 0.0)]
    if pipe is not None:
        S, M = pipe.pipe.stages, pipe.pipe.microbatches
        costs = [c * (1 - (S - 1) / (M + S - 1)) for c in costs]
    return min([*costs, *(cost.step_s for _, _, cost in other)])
