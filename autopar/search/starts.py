"""The plans `dp` polishes where its own solve guessed (`layers.Start`): recursive's,
a recipe's plan as data parallelism, and Megatron's layout on each mesh axis
(docs/algorithms.md, section 1)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from autopar.search import engines, layouts, recipes
from autopar.search.build import Problem


def dp_starts(problem: Problem, g, pinned: Mapping[int, int], recipe: bool = False) -> list:
    """The starts `solve_dp_layered` polishes where dp guesses (`layers.Start`), on `g`
    (the problem's cost graph with `pinned` applied): recursive's plan before its cone
    rounds (from the plan after them, dp's descent on the tiny Llama of
    `tests/test_optimality.py` on data 2 x model 4 stopped 36% higher); for a recipe
    (`data`, `fsdp`) whose plan pays a gather penalty, its plan as data parallelism
    runs (`recipes.batch_wave`, whose descent takes more rounds: MobileNet's improved
    for 18); otherwise plans from Megatron's layout with each mesh axis as the tensor
    axis (`_tensor_start`, completed by `recursive` and by propagation), which descend
    further only while they beat dp's own plan. On GPT-6.7B's step (data 4 x model 4)
    dp's own solves, and the descent from recursive's plan, stayed 3.9% above the
    descent from Megatron's layout under the objective."""
    from autopar.search.layers import POLISH

    plans = [(lambda p, pins: engines.recursive_plans(p, pins)[1], (30, 3), 0.0)]
    if recipe:
        plans.append((recipes.batch_wave, POLISH, recipes.DATA_GATHER_PENALTY))
    else:
        mesh, seen = problem.mesh, []
        for axis in (a for a, n in zip(mesh.axis_names, mesh.axis_sizes) if n > 1):
            start = {**layouts.tensor_pins(problem, axis), **pinned}
            if start in seen:  # the pins fix all this axis's layout would set (a loop
                continue  # body's candidates with every argument pinned): the same start
            seen.append(start)
            for engine in ("recursive", "propagate"):
                plans.append((_tensor_start(start, engine), ((30, 3), POLISH), 0.0))
    return [(lambda f=f: g.lower_choice(f(problem, pinned), pinned), *r) for f, *r in plans]


def _tensor_start(
    start: Mapping[int, int], engine: str
) -> Callable[[Problem, Mapping[int, int]], list[int]]:
    """A plan from Megatron's layout with one mesh axis as the tensor axis
    (`layouts.tensor_pins`) under the user's pins (`start`, the two merged): recursive's
    plan from those pins, or (`engine` "propagate") the pins propagated and refined. The
    descent is free to move every pin but the user's."""

    def plan(p: Problem, pins: Mapping[int, int]) -> list[int]:
        if engine == "recursive":
            return engines.recursive(p, start)
        return engines.refine(p, engines.propagate(p, start), pins, 8)

    return plan
