"""Engines and the driver that picks among them under a memory budget.

The driver searches a built `Problem`; it imports neither `search.nested` nor
`search.problem`, which sit above it (building a problem searches its scan bodies
and cond branches with this driver)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from autopar.cost.model import Cost
from autopar.errors import BUDGET_HINT, MemoryBudgetError, format_bytes
from autopar.search import engines, layouts, recipes, workers
from autopar.search.build import Problem
from autopar.search.evaluate import evaluate, total_time
from autopar.search.fold import fold as folding
from autopar.search.fold import folded_engine
from autopar.search.polish import lean_arguments, polish
from autopar.search.result import SearchResult, SolverInfo
from autopar.search.starts import dp_starts
from autopar.search.transplant import transplant

log = logging.getLogger("autopar")  # shown by `autopar.compile.progress`


def _dp(
    problem: Problem, pinned: Mapping[int, int], info: SolverInfo, recipe: bool = False
) -> list[int]:
    from autopar.search.layers import KEEP, solve_dp_layered

    g = problem.cost_graph().restrict(pinned)
    starts = dp_starts(problem, g, pinned, recipe)
    keep = 0 if problem.loop_body else KEEP  # a loop body's layers are all alike
    sol = solve_dp_layered(problem, g, pinned, keep=keep, starts=starts)
    info.update(optimal=sol.optimal, gap=sol.gap)
    # `search.run` polishes the runner-up too and keeps it where its price is lower; a
    # recipe's runner-up that pays the gather penalty is no recipe plan (a ResNet's
    # `data` runner-up gathered the images and ran replicated, cheaper at batch 16).
    runner = sol.info.get("runner_up")
    if runner is not None and not (recipe and g.total(runner) >= recipes.DATA_GATHER_PENALTY):
        info["alternates"] = [g.lift_choice(list(runner), pinned)]
    best = transplant(problem, g.lift_choice(list(sol.choice), pinned), pinned)
    if recipe:
        return best
    # The step run whole on every device: on a 6-layer MLP with a clipped AdamW at batch
    # 128 (8 devices), every op latency-bound, the optimum, where every engine returned
    # data parallelism at 1.84x it (no move short of all of them leaves it).
    whole = [pinned.get(v, s) for v, s in enumerate(layouts.replicated_plan(problem))]
    if total_time(problem, whole) < total_time(problem, best):
        info["alternates"] = [best, *info.get("alternates", ())]
        best = whole
    return best


def _recursive(problem: Problem, pinned: Mapping[int, int], info: SolverInfo) -> list[int]:
    """`engines.recursive`'s plan, with its plan before the cone rounds as the runner-up:
    the objective charges each all-gather and reduce-scatter a latency of its own where
    the final price combines them (a ZeRO-3 plan's many small all-gathers), so a plan
    the cone rounds made cheaper under it can price higher in the end (a Llama step's
    ZeRO-3 plan: 3.8% lower objective, 2.3% higher final price); the driver keeps the
    cheaper."""
    plan, before = engines.recursive_plans(problem, pinned)
    plan = transplant(problem, plan, pinned)
    if plan != before:
        info["alternates"] = [before]
    return plan


def _ilp(problem: Problem, pinned: Mapping[int, int], info: SolverInfo) -> list[int]:
    from autopar.search.solvers.ilp import solve_ilp

    g = problem.cost_graph().restrict(pinned)
    warm = g.lower_choice(engines.recursive(problem, pinned), pinned)
    sol = solve_ilp(g, time_limit=ILP_TIME_LIMIT_S, warm_start=warm)
    info.update(optimal=sol.optimal, gap=sol.gap, status=str(sol.info.get("status", "")))
    return g.lift_choice(sol.choice, pinned)


ILP_TIME_LIMIT_S = 60.0


def _recipe(problem: Problem, pinned: Mapping[int, int], info: SolverInfo) -> list[int]:
    return _dp(problem, pinned, info, recipe=True)


# An engine maps (problem, pinned nodes, info to fill) to one strategy index per node.
Engine = Callable[[Problem, Mapping[int, int], SolverInfo], list[int]]
ENGINES: dict[str, Engine] = {
    # all but the yardstick search a deep stack's problem folded to three of its layers
    # (`search.fold`: repeated layers searched once, flat in depth) and lift the plan
    "recursive": folded_engine(_recursive),
    "dp": folded_engine(_dp),
    "ilp": _ilp,
    # Baselines fix the arguments' specs and let `dp` complete the rest optimally.
    # solved on a problem that penalizes gathering a split value: `data` is data
    # parallelism (batch split, parameters replicated), never a gathered batch
    "data": lambda p, pins, info: folded_engine(_recipe)(
        recipes.data_problem(p), {**layouts.data_pins(p), **pins}, info
    ),
    # ZeRO-3: parameters sharded and gathered where used, the rest data parallel
    "fsdp": lambda p, pins, info: folded_engine(_recipe)(
        recipes.zero3_problem(p), {**layouts.fsdp_pins(p), **pins}, info
    ),
    "propagate": folded_engine(lambda p, pins, info: engines.propagate(p, pins)),
}
# The argument specs a recipe engine fixes (the equal-price memory polish keeps them).
RECIPE_PINS = {"data": layouts.data_pins, "fsdp": layouts.fsdp_pins}
AUTO_ENGINES = ("recursive", "dp", "data")
# `auto` also ranks ZeRO-3 (parameters and optimizer state sharded over every device,
# gathered where used) as a speed candidate, not only as a memory retry: `recursive` with
# those pins, cheap next to `dp`. FSDP can be the fastest layout of a 2-D mesh: on a
# Llama-style step on data 2 x model 4 it compiles 2% below plain `jax.jit` FSDP where
# `dp`'s own plan, stuck in a worse local optimum of the objective, was 4% above it.
AUTO_ZERO3 = "recursive+zero3"
# Run by `auto` only when none of AUTO_ENGINES' plans (nor their ZeRO retries) fits the
# budget: `fsdp` is `dp` with every argument pinned sharded, so it trades time for
# memory; its optimum is never below the unpinned one under the objective they share.
AUTO_MEMORY_FALLBACK = ("fsdp",)


class _NoClock:
    """The clock of a search nobody times (`autopar.compile.clock.Clock` is the real one:
    `phase(name)` times a phase, `out_of_time()` says `time_limit=` is reached, `skip(what)`
    names the work left out, `worked(name, s)` takes what search workers spent)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def out_of_time(self) -> bool:
        return False

    def skip(self, what: str) -> None:
        pass

    def worked(self, name: str, seconds: float) -> None:
        pass


class _Runner:
    """One engine's search of a problem, its plan polished and priced (`run`): what
    `search` does per engine, in this process or, as a `task`, in a search worker."""

    def __init__(self, problem: Problem, clock: Any, memory_budget: float):
        self.problem, self.clock, self.budget = problem, clock, memory_budget
        self.info: dict[str, SolverInfo] = {}

    def priced(self, choice) -> Cost:
        with self.clock.phase("evaluate"):
            return evaluate(self.problem, choice)

    def run(self, name: str, pins: Mapping[int, int], key: str) -> tuple[list[int], Cost]:
        self.info[key] = {}
        with self.clock.phase(name):
            choice = ENGINES[name](self.problem, pins, self.info[key])
        alternates = self.info[key].pop("alternates", [])
        choice, cost, saved = self.polished(choice, pins, key)
        if alternates and self.clock.out_of_time():
            self.clock.skip(f"the runner-up of {key} on {self.problem.mesh.shape} (the time limit)")
            alternates = []
        for alt in alternates:
            # an engine's runner-up under its objective, which the latency polish can
            # put ahead (dp's starts: the polish took one plan 9% lower, another the
            # objective ranked cheaper 1%)
            other, other_cost, other_saved = self.polished(alt, pins, key)
            fits = other_cost.peak_memory_bytes <= self.budget
            if other_cost.step_s < cost.step_s and (
                fits or other_cost.peak_memory_bytes <= cost.peak_memory_bytes
            ):
                choice, cost, saved = other, other_cost, other_saved
        if saved:
            self.info[key]["polished_s"] = saved
        recipe = RECIPE_PINS[name](self.problem) if name in RECIPE_PINS else {}
        return self.leaner(choice, cost, {**recipe, **pins}, key)

    def polished(self, choice, pins: Mapping[int, int], key: str) -> tuple[list[int], Cost, float]:
        """`choice` after the latency polish, its price, and the seconds the polish saved
        (0 where its plan was not kept)."""
        # the engine's plan is priced only where needed: a polished plan that fits
        # replaces it unpriced (a pricing of the 175B step takes 1.6 s)
        cost = None
        if self.clock.out_of_time():
            cost = self.priced(choice)
            if cost.peak_memory_bytes <= self.budget:
                self.clock.skip(f"the latency polish of {key} on {self.problem.mesh.shape}")
                return choice, cost, 0.0
        cut = []

        def stop() -> bool:
            if self.clock.out_of_time():
                cut.append(True)
            return bool(cut)

        timed = {"stop": stop} if getattr(self.clock, "deadline", None) is not None else {}
        with self.clock.phase("polish"):
            # the moves looked for in one copy of each repeated layer (`search.fold`)
            folded = folding(self.problem, pins)
            moved, saved = polish(self.problem, choice, pins, folded=folded, **timed)
        if cut:
            self.clock.skip(f"the rest of the latency polish of {key} on {self.problem.mesh.shape}")
        if saved > 0:
            better = self.priced(moved)
            if better.peak_memory_bytes <= self.budget or (
                better.peak_memory_bytes <= (cost := cost or self.priced(choice)).peak_memory_bytes
            ):
                return moved, better, saved
        return choice, cost or self.priced(choice), 0.0

    def leaner(self, choice, cost: Cost, pins, key: str) -> tuple[list[int], Cost]:
        """The plan with `lean_arguments`, when that keeps its price and saves memory."""
        with self.clock.phase("polish"):
            lean = lean_arguments(self.problem, choice, pins)
        if lean == list(choice):
            return choice, cost
        with self.clock.phase("evaluate"):
            new = evaluate(self.problem, lean)
        if (
            new.step_s <= cost.step_s * (1 + 1e-9)
            and new.argument_bytes < cost.argument_bytes
            and new.peak_memory_bytes <= cost.peak_memory_bytes
        ):
            self.info[key]["lean_arguments_bytes"] = cost.argument_bytes - new.argument_bytes
            return lean, new
        return choice, cost

    def task(self, name: str, pins: Mapping[int, int], key: str) -> Callable[[], Any]:
        """`run` for `workers.run_all`: its plan and the solver's info."""
        return lambda: (self.run(name, pins, key), self.info[key])

    def seeded(self, seed: Seed, pins: Mapping[int, int], key: str):
        """A seed's plan (`search`'s `seeds`) polished, leaner and priced as an engine's,
        and the seed's info; None where the seed has no plan."""
        self.info[key] = {}
        with self.clock.phase("seed"):
            choice = seed(self.info[key])
        if choice is None:
            return None
        choice, cost, saved = self.polished(list(choice), pins, key)
        if saved:
            self.info[key]["polished_s"] = saved
        return self.leaner(choice, cost, pins, key), self.info[key]


# A plan made outside the engines (`compile.merged`: the plan of the mesh with its axes
# merged, as a plan of this mesh): given the info to fill, the plan or None.
Seed = Callable[[SolverInfo], Sequence[int] | None]


def _zero_pins(problem: Problem, pinned: Mapping[int, int]) -> dict[int, int]:
    """ZeRO-3's pins of the arguments a step updates (`layouts.fsdp_pins`), but the
    user's."""
    return {
        i: s
        for i, s in layouts.fsdp_pins(problem).items()
        if i not in pinned and i in problem.aliases.values()
    }


def first_searches(
    problem: Problem,
    engine: str,
    pinned: Mapping[int, int] = {},  # noqa: B006
) -> dict[str, tuple[str, Mapping[int, int]]]:
    """The searches `search` starts with, independent of each other ({key: (engine,
    pins)}): `engine`, or `auto`'s engines and its ZeRO-3 candidate (the memory
    fallback and the ZeRO retries depend on their plans)."""
    names = AUTO_ENGINES if engine == "auto" else (engine,)
    early = {n: (n, pinned) for n in names if n not in AUTO_MEMORY_FALLBACK}
    zero_pins = _zero_pins(problem, pinned)
    if engine == "auto" and not problem.loop_body and zero_pins:
        early[AUTO_ZERO3] = ("recursive", {**zero_pins, **pinned})
    return early


def first_tasks(
    problem: Problem,
    engine: str,
    memory_budget: float,
    pinned: Mapping[int, int] = {},  # noqa: B006
    clock: Any = None,
) -> dict[str, Callable[[], Any]]:
    """`first_searches` as tasks for `workers.run_all`, to run side by side with the
    searches of other problems; `search(..., first=their results)` takes them, to the
    same plan as it would find alone."""
    runner = _Runner(problem, clock or _NoClock(), memory_budget)
    return {
        key: runner.task(n, p, key)
        for key, (n, p) in first_searches(problem, engine, pinned).items()
    }


def search(
    problem: Problem,
    engine: str,
    memory_budget: float,
    pinned: Mapping[int, int] = {},  # noqa: B006
    clock: Any = None,
    sure_fit: float = 1.0,
    first: Mapping[str, Any] | None = None,
    seeds: Mapping[str, Seed] | None = None,
) -> SearchResult:
    """Run `engine` ("auto": `AUTO_ENGINES`, then `fsdp` if no plan fits); if its plan
    does not fit `memory_budget`,
    retry with the optimizer state sharded over every device (ZeRO-1; ZeRO-2 is the
    same in one fused step, and under gradient accumulation the loop's accumulators
    sharded too), with the parameters sharded too (ZeRO-3; under accumulation also
    gathered in the loop, each micro-batch), and then, for
    functions with loops, with ZeRO-3 and each loop held to a strategy whose stacked
    inputs take at most 1/2, 1/4, 1/8 of the budget (`layouts.loop_pins`), until one
    fits. Returns the fastest plan that fits; raises MemoryBudgetError if none does.

    `clock` (`autopar.compile.clock.Clock`) times each engine, the pricing and the
    polish; once it is out of time, the engines still to run and the polish are left
    out (and named to it) as soon as some plan fits.

    A plan predicted above `sure_fit` x the budget may still be turned away (the driver
    compiles such plans to check their memory), so the ZeRO retries run for it too and
    stay candidates behind it.

    `first`: the results of `first_tasks`, run elsewhere (side by side with the
    searches of other problems); a task missing from it was stopped at the time limit.

    `seeds`: plans made outside the engines ({name: `Seed`}), polished and priced as
    theirs and ranked with them (after them at equal price); a seed with no plan is
    left out."""
    clock = clock or _NoClock()
    if engine != "auto" and engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of: auto, {', '.join(ENGINES)}")
    start = time.perf_counter()
    names = AUTO_ENGINES + AUTO_MEMORY_FALLBACK if engine == "auto" else (engine,)
    candidates: dict[str, tuple[list[int], Cost]] = {}
    zero_pins = _zero_pins(problem, pinned)
    opt_state = layouts.optimizer_state_inputs(problem)
    # ZeRO-1: only the optimizer state sharded (a fused step reduce-scatters the
    # gradients into it, so without accumulation it is ZeRO-2 too); ZeRO-2 under
    # gradient accumulation: the accumulated gradients sharded as well (the loop on its
    # "dp+zero2" body, the optimizer state as ZeRO-1 has it); ZeRO-3: the parameters
    # too, gathered before an accumulation loop or, "zero3+per-micro-batch", in it
    zero_stages = {
        "zero1": {i: s for i, s in zero_pins.items() if i in opt_state},
        "zero2": layouts.accumulation_pins(problem, "dp+zero2"),
        "zero3": zero_pins,
    }
    if in_loop := layouts.accumulation_pins(problem, "dp+zero3"):
        zero_stages["zero3+per-micro-batch"] = {**zero_pins, **in_loop}
    # Loops whose stacked inputs, as their body reads them, take at most 1/2, 1/4, 1/8
    # of the budget (with ZeRO-3): a body that keeps its weights whole is fastest, but
    # the whole stack of them must then sit on every device.
    if any(n.body is not None for n in problem.graph.nodes) and memory_budget < float("inf"):
        for f in (2, 4, 8):
            lean = layouts.loop_pins(problem, memory_budget / f)
            lean = {k: s for k, s in lean.items() if k not in pinned}
            if lean:
                zero_stages[f"zero3+loops/{f}"] = {**zero_pins, **lean}

    runner = _Runner(problem, clock, memory_budget)
    info, run = runner.info, runner.run

    def fits_any() -> bool:
        return any(v[1].peak_memory_bytes <= memory_budget for v in candidates.values())

    # `auto`'s engines and its ZeRO-3 candidate are independent: on a big enough problem
    # they run side by side (`search.workers`), then the ZeRO retries of those over
    # budget; the loops below take their results
    early = first_searches(problem, engine, pinned)
    seeds = dict(seeds or {})
    n_workers = workers.usable(len(problem.strategies), len(early) + len(seeds))
    done: dict[str, tuple[tuple[list[int], Cost], SolverInfo]] = dict(first or {})

    def side_by_side(batch: dict[str, tuple[str, Mapping[int, int]]], more=None) -> None:
        log.info(
            "mesh %s: searching with %s side by side (%d workers)",
            problem.mesh.shape,
            ", ".join([*batch, *(more or {})]),
            n_workers,
        )
        got = workers.run_all(
            {
                **{key: runner.task(n, p, key) for key, (n, p) in batch.items()},
                **{
                    key: lambda f=f, k=key: runner.seeded(f, pinned, k)
                    for key, f in (more or {}).items()
                },
            },
            n_workers,
            clock,
            enough=lambda got: any(
                r is not None and r[0][1].peak_memory_bytes <= memory_budget for r in got.values()
            ),
        )
        done.update({k: r for k, r in got.items() if r is not None})

    def over(key: str) -> bool:  # a plan that gets the ZeRO retries
        return key in done and done[key][0][1].peak_memory_bytes > memory_budget * sure_fit

    def retries(name: str, choice: Sequence[int]) -> Iterator[tuple[str, dict[int, int]]]:
        """The ZeRO retries of engine `name`'s plan `choice` (over the budget): ZeRO-1
        (and ZeRO-2's optimizer state) splits the optimizer state further than `choice`
        does (`layouts.aligned_pins`)."""
        for stage, pins in zero_stages.items():
            if stage in ("zero1", "zero2") and pins:
                aligned = layouts.aligned_pins(problem, choice, opt_state - set(pinned))
                if stage == "zero2":
                    aligned = {**aligned, **pins}
                pins = aligned if any(choice[i] != k for i, k in aligned.items()) else {}
            if pins and not (stage == "zero1" and pins == zero_pins):
                yield stage, pins

    batches = [early]
    handed: set[str] = set()
    if n_workers > 1 or first is not None:
        if first is None:
            side_by_side(early, seeds)
            handed = set(seeds)  # to the workers: their results (or none) are in `done`
        batches.append(
            {
                f"{n}+{stage}": (n, {**pins, **pinned})
                for n in names
                if over(n) and n not in ("data", "fsdp")
                for stage, pins in retries(n, done[n][0][0])
                if "loops" not in stage and f"{n}+{stage}" not in done
            }
        )
        fit = any(r[0][1].peak_memory_bytes <= memory_budget for r in done.values())
        if fit and clock.out_of_time():
            for key in batches[-1]:
                clock.skip(f"{key} on {problem.mesh.shape} (not started: the time limit)")
        elif batches[-1]:
            side_by_side(batches[-1])
    # stopped by the time limit
    side = n_workers > 1 or first is not None
    stopped = {k for b in batches for k in b} - set(done) if side else set()

    def take(name: str, pins: Mapping[int, int], key: str) -> tuple[list[int], Cost]:
        if key in done:
            result, info[key] = done.pop(key)
            return result
        return run(name, pins, key)

    for i, name in enumerate(names):
        if name in AUTO_MEMORY_FALLBACK and engine == "auto" and fits_any():
            info["skipped"] = {name: "a plan of the other engines fits the memory budget"}
            continue
        if name in stopped:
            continue
        if fits_any() and clock.out_of_time() and name not in done:
            clock.skip(f"engines {', '.join(names[i:])} on {problem.mesh.shape}")
            break
        if name not in done:
            log.info("mesh %s: searching with %s", problem.mesh.shape, name)
        candidates[name] = take(name, pinned, name)
        if candidates[name][1].peak_memory_bytes <= memory_budget * sure_fit or name in (
            "data",
            "fsdp",
        ):
            continue
        fits = False
        for stage, pins in retries(name, candidates[name][0]):
            if fits and "loops" in stage:  # leaner loops only trade speed for memory
                break
            key = f"{name}+{stage}"
            if key in stopped:
                continue
            log.info("mesh %s: %s over budget, retrying with %s", problem.mesh.shape, name, stage)
            candidates[key] = take(name, {**pins, **pinned}, key)
            fits |= candidates[key][1].peak_memory_bytes <= memory_budget * sure_fit
    if (
        engine == "auto"
        and not problem.loop_body  # a loop's body: its carry is no state to shard
        and AUTO_ZERO3 not in candidates  # not already run as a memory retry
        and AUTO_ZERO3 not in stopped
        and zero_pins
    ):
        if fits_any() and clock.out_of_time() and AUTO_ZERO3 not in done:
            clock.skip(f"{AUTO_ZERO3} on {problem.mesh.shape}")
        else:
            if AUTO_ZERO3 not in done:
                log.info("mesh %s: searching with %s", problem.mesh.shape, AUTO_ZERO3)
            candidates[AUTO_ZERO3] = take("recursive", {**zero_pins, **pinned}, AUTO_ZERO3)
    for key, seed in seeds.items():  # handed out and not done: no plan, or stopped
        if key not in handed and fits_any() and clock.out_of_time():
            clock.skip(f"{key} on {problem.mesh.shape} (the time limit)")
            continue
        if key not in handed:
            log.info("mesh %s: searching with %s", problem.mesh.shape, key)
        got = done.pop(key, None) if key in handed else runner.seeded(seed, pinned, key)
        if got is not None:
            candidates[key], info[key] = got
    fitting = {k: v for k, v in candidates.items() if v[1].peak_memory_bytes <= memory_budget}
    if not fitting:
        best = min(candidates.items(), key=lambda kv: kv[1][1].peak_memory_bytes)
        error = MemoryBudgetError(
            f"no plan fits the memory budget of {format_bytes(memory_budget)} per device; the smallest found "
            f"({best[0]}) needs {format_bytes(best[1][1].peak_memory_bytes)} "
            f"({format_bytes(best[1][1].argument_bytes)} of it arguments).\n"
            f"{_dominant(problem, best[1][0])}\n{BUDGET_HINT}"
        )
        # the fastest plan of any memory: a bound for `remat="auto"` (`compile.tries`)
        error.fastest = min(c.step_s for _, c in candidates.values())
        raise error
    ranked = sorted(
        fitting.items(), key=lambda kv: (kv[1][1].step_s, list(candidates).index(kv[0]))
    )
    name, (choice, cost) = ranked[0]
    return SearchResult(
        tuple(choice),
        name,
        cost,
        time.perf_counter() - start,
        {k: v[1] for k, v in candidates.items()},
        tuple((k, tuple(c), cost) for k, (c, cost) in ranked),
        {k: v for k, v in info.items() if v},
    )


def _dominant(problem: Problem, choice, top: int = 3) -> str:
    """The largest arguments and the largest intermediates (with source lines) per device."""
    g, n_in = problem.graph, problem.num_inputs
    args = sorted(
        (
            (problem.node_mem[i][choice[i]], g.input_paths[i], g.values[g.inputs[i]])
            for i in range(n_in)
        ),
        key=lambda x: -x[0],
    )[:top]
    inter = []
    for node in g.nodes:
        s = problem.strategies[n_in + node.id][choice[n_in + node.id]]
        for v, spec in zip(node.outputs, s.out_specs):
            inter.append((problem.cost.local_bytes(g.values[v], spec), node, g.values[v], v))
    inter = sorted(inter, key=lambda x: (-x[0], x[1].id))[:top]
    return (
        "Largest arguments per device: "
        + "; ".join(f"{p} {t} -> {format_bytes(b)}" for b, p, t in args)
        + "\nLargest intermediates per device: "
        + "; ".join(f"{_made_by(n, v)} {t} -> {format_bytes(b)}" for b, n, t, v in inter)
    )


def _made_by(node, v: int) -> str:
    """Where value `v` (an output of `node`) is made in the user's code: a loop's result
    (a gradient summed over the accumulation loop, a layer loop's output) by the op of
    its body that makes it, not the loop autopar's passes wrote."""
    while node.body is not None:
        inner = node.body.outputs[node.outputs.index(v)]
        body = node.body
        maker = next((n for n in body.nodes if inner in n.outputs), None)
        if maker is not None and maker.op in ("add", "add_any"):
            # a sum carried over the loop (`c + g`): named by what it sums
            fresh = [u for u in maker.inputs if u not in body.inputs]
            if len(fresh) == 1:
                inner = fresh[0]
                maker = next((n for n in body.nodes if inner in n.outputs), maker)
        if maker is None:  # passed through the body unchanged
            break
        node, v = maker, inner
    return f"{node.op} at {node.key}"
