"""Mesh-shape search's screen: every shape's plan by `recursive` (one pass, no polish),
priced before any full search. All shapes have the same FLOP floor, so this price
orders them and bounds which are worth a full search (`compile.driver`); a shape the
cost model cannot tell from one before it (`meshes.equivalent`) is neither screened
nor searched. Where `search.workers` allows, the shapes are screened side by side in
forked workers (each builds its own problem; the driver builds again the few it then
searches in full)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from autopar.compile.clock import Clock, left_out, try_name
from autopar.errors import MeshError
from autopar.ir.graph import Graph
from autopar.meshes import equivalent
from autopar.search import ENGINES, workers
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
) -> tuple[dict[int, float], dict[int, Problem], dict[int, int]]:
    """The screen of `tries` (mesh, no pipeline): ({try index: screen price}, {try
    index: its problem} for the shapes that may still be searched in full, {try index:
    the earlier try it equals}). A shape left out at `time_limit=` is priced inf."""
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
        return cost.step_s, cost.peak_memory_bytes <= budget, problem

    screened: dict[int, float] = {}
    built: dict[int, Problem] = {}
    fits: dict[int, bool] = {}
    n = workers.usable(len(graph.nodes), len(infos))
    if n > 1:
        log.info("screening %d mesh shapes with recursive side by side (%d workers)", len(infos), n)
        done = workers.run_all(
            {try_name(infos[s].shape, None): (lambda s=s: one(s)[:2]) for s in infos},
            n,
            clock,
            phase="screen",
        )
        for step in infos:
            price, fit = done.get(try_name(infos[step].shape, None), (math.inf, False))
            if not math.isnan(price):  # problems are built again where searched in full
                screened[step], fits[step] = price, fit
        return screened, built, same
    for k, step in enumerate(infos):
        if screened and clock.out_of_time():  # the rest are left out, and named
            rest = list(infos)[k:]
            clock.skip("the screen and search of " + left_out(tries, rest, None))
            screened.update(dict.fromkeys(rest, math.inf))
            break
        log.info(
            "mesh %s: screening with recursive",
            infos[step].shape,
            extra={"autopar_step": (step + 1, len(tries))},
        )
        price, fit, problem = one(step)
        if problem is None:
            continue
        screened[step], built[step], fits[step] = price, problem, fit
        # a full search keeps recursive's plan if it fits: the best such screen price
        # bounds the best price, and the problems of shapes above the margin can go
        top = min((screened[j] for j in fits if fits[j]), default=math.inf)
        for j in [j for j in built if screened[j] > SCREEN_MARGIN * top]:
            del built[j]
    return screened, built, same
