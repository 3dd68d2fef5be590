"""Mesh-shape search's screen: every shape's plan by `recursive` (on two or more axes
also from data parallelism's pins, the cheaper kept), priced before any full search.
All shapes have the same FLOP floor, so this price orders them and bounds which are
worth a full search (`compile.driver`); a shape the cost model cannot tell from one
before it (`meshes.equivalent`) is neither screened nor searched. Where
`search.workers` allows, the shapes are screened side by side: this process screens
the shapes costliest to build and keeps their problems for the full search, forked
workers screen the rest (the driver builds again the problem of a worker's shape it
then searches in full)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from autopar.compile.clock import Clock, left_out
from autopar.errors import MeshError
from autopar.ir.graph import Graph
from autopar.meshes import equivalent
from autopar.search import ENGINES, layouts, workers
from autopar.search.evaluate import evaluate
from autopar.search.problem import Problem

# Mesh-shape search: a shape whose `recursive` plan is priced above this many times the
# best plan found is not searched in full. A heuristic, not a bound: on the 7B
# Llama-style step the full search's plan was 0.33-1.0x `recursive`'s on the same shape
# (lowest where the model axis is 32-128 wide), and every shape this margin leaves out
# there had a full-search plan >= 1.33x the best (docs/features.md, mesh-shape search).
SCREEN_MARGIN = 2.0
log = logging.getLogger("autopar")


def screen(
    graph: Graph,
    tries: list,
    clock: Clock,
    info_of: Callable[[Any], Any],
    build: Callable[[Any], Problem],
    pins_of: Callable[[Problem], dict | MeshError],
    budget: float,
    which: Sequence[int] | None = None,
) -> tuple[dict[int, float], dict[int, Problem], dict[int, int]]:
    """The screen of `tries` (mesh, no pipeline; `which`: the indices of those to
    screen, default all): ({try index: screen price}, {try index: its problem} for the
    shapes that may still be searched in full, {try index: the earlier try it
    equals}). A shape left out at `time_limit=` is priced inf."""
    if which is not None:  # the others' indices, mapped back
        got = screen(graph, [tries[i] for i in which], clock, info_of, build, pins_of, budget)
        prices, built = ({which[k]: v for k, v in d.items()} for d in got[:2])
        return prices, built, {which[k]: which[j] for k, j in got[2].items()}
    infos: dict[int, Any] = {}
    same: dict[int, int] = {}  # try -> the earlier try it is the same mesh as
    for step, (_, mesh, _) in enumerate(tries):
        info = info_of(mesh)
        twin = next((j for j, other in infos.items() if equivalent(other, info)), None)
        if twin is not None:  # the cost model cannot tell them apart: one search
            same[step] = twin
        else:
            infos[step] = info

    def one(step: int) -> tuple[float, bool, Problem | None]:
        problem = build(infos[step])
        pins = pins_of(problem)
        if isinstance(pins, MeshError):
            return math.nan, False, None  # its full search reports why
        with clock.phase("screen"):
            cost = evaluate(problem, ENGINES["recursive"](problem, pins, {}))
            if sum(n > 1 for n in problem.mesh.axis_sizes) > 1:
                # and from data parallelism's pins: D-Rec's greedy cuts on two axes can
                # leave a plan of reshards no polish undoes (a UNet on data 2 x model 4:
                # 11x the full search's plan, and `mesh=8` kept a 2.7x dearer shape)
                data = {**layouts.data_pins(problem), **pins}
                other = evaluate(problem, ENGINES["recursive"](problem, data, {}))
                cost = min(cost, other, key=lambda c: c.step_s)
        return cost.step_s, cost.peak_memory_bytes <= budget, problem

    built: dict[int, Problem] = {}

    def in_order(steps: list[int], keep: bool) -> dict[int, tuple[float, bool]]:
        """{step: (screen price, fits the budget)} of `steps`, screened in order in
        this process; with `keep`, the problems of those within the margin are kept
        in `built`. Past `time_limit=` the rest are left out (priced inf) and named."""
        got: dict[int, tuple[float, bool]] = {}
        for k, step in enumerate(steps):
            if got and clock.out_of_time():
                rest = steps[k:]
                clock.skip("the screen and search of " + left_out(tries, rest, None))
                got.update(dict.fromkeys(rest, (math.inf, False)))
                break
            log.info(
                "mesh %s: screening with recursive",
                infos[step].shape,
                extra={"autopar_step": (step + 1, len(tries))},
            )
            price, fit, problem = one(step)
            if problem is None:
                continue  # its full search reports why
            got[step] = (price, fit)
            if keep:
                built[step] = problem
                _drop_over_margin(built, got)
        return got

    n = workers.usable(len(graph.nodes), len(infos))
    if n > 1:
        mine, theirs = _shares(infos, n)
        log.info(
            "screening %d mesh shapes with recursive side by side (%d here, the rest in %d "
            "workers)",
            len(infos),
            len(mine),
            len(theirs),
        )
        here: dict[int, tuple[float, bool]] = {}
        done = workers.run_all(
            {k: (lambda steps=steps: in_order(steps, False)) for k, steps in enumerate(theirs)},
            len(theirs),
            clock,
            phase="screen",
            beside=lambda: here.update(in_order(mine, True)),
            label=lambda k: "the screen of " + ", ".join(str(infos[s].shape) for s in theirs[k]),
        )
        results = [here, *done.values()]
    else:
        results = [in_order(list(infos), True)]
    every = {step: got for part in results for step, got in part.items()}
    _drop_over_margin(built, every)
    return {step: price for step, (price, _) in every.items()}, built, same


def _drop_over_margin(built: dict[int, Problem], got: dict[int, tuple[float, bool]]) -> None:
    """A full search keeps recursive's plan if it fits: the best such screen price in
    `got` bounds the best price, and the problems of shapes above the margin can go."""
    top = min((price for price, fit in got.values() if fit), default=math.inf)
    for j in [j for j in built if j in got and got[j][0] > SCREEN_MARGIN * top]:
        del built[j]


def _shares(infos: dict[int, Any], procs: int) -> tuple[list[int], list[list[int]]]:
    """The screen's steps split between this process and `procs - 1` workers, each
    list in the tries' order: the costliest shapes first, each to the least loaded,
    this process first among equals. A problem built here is kept for the full search
    and one built in a worker is built again, so this process takes the costliest
    shape. A shape's work is counted as 4x per mesh axis (more axes, more strategies
    per op: on the 7B step a 3-axis shape took ~1.9 s to build and screen, a 2-axis
    one ~0.45 s)."""
    work = {s: 4 ** sum(1 for n in infos[s].shape.values() if n > 1) for s in infos}
    bins: list[list[int]] = [[] for _ in range(procs)]
    loads = [0] * procs
    for s in sorted(infos, key=lambda s: (-work[s], s)):
        b = loads.index(min(loads))
        bins[b].append(s)
        loads[b] += work[s]
    return sorted(bins[0]), [sorted(steps) for steps in bins[1:] if steps]
