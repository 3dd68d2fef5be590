"""The driver: one call's function and arguments to a plan and its `jax.jit`.

`compile_step` traces the function, runs the passes (mixed precision, remat, gradient
accumulation), prices every (remat policy, mesh, pipeline) the options allow, searches
each, makes the plan of the fastest and, when that plan comes close to the memory
budget, compiles it once on the mesh to check it (the liveness estimate does not see
XLA's own temporaries). An option that gives no plan comes back as an `Infeasible`
value carrying the user's error (turned into a value once, where a pass or the search
raises it), so the tries move on by looking at values; when it was the only option,
that error is raised. Plans are made and bound in `compile.plans`."""

from __future__ import annotations

import gc
import logging
import math
import warnings
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

from jax.sharding import AbstractMesh, Mesh

from autopar.compile.calls import Call, Compiled, Options, Proxy, pipeline_of
from autopar.compile.clock import Clock, left_out, try_name
from autopar.compile.lowering import compiled_memory, info_str, lowered
from autopar.compile.merged import merged_seeds
from autopar.compile.notes import (
    floored_note,
    grouped,
    held_back,
    no_pipeline_why,
    offline_warning,
    over_floor,
    pipeline_tries,
    plan_warnings,
    screen_note,
    unsplittable,
)
from autopar.compile.pipelines import (
    Infeasible,
    PipelineTries,
    graph_of,
    proxied,
    roll_of,
)
from autopar.compile.plans import (
    attach,
    make_plan,
    mesh_for_plan,
    plan_mismatch,
    reusable_specs,
    spec_pins,
    user_pins,
)
from autopar.compile.realize import Realizing
from autopar.compile.screen import SCREEN_MARGIN, screen
from autopar.compile.tries import Earlier, ahead, bound, firsts_ahead
from autopar.cost.model import CostModel
from autopar.errors import (
    BUDGET_HINT,
    AutoparError,
    CaptureError,
    MemoryBudgetError,
    MeshError,
    MicrobatchError,
    PlanError,
    format_bytes,
    user_level,
)
from autopar.ir.capture import capture, fn_name
from autopar.ir.graph import Graph
from autopar.lower.jit import jit_from_plan
from autopar.lower.rolled import abstract_inputs
from autopar.meshes import drops_barriers
from autopar.passes.accumulate import accumulate, batch_hint, micro_batch_args
from autopar.passes.pipeline import Pipeline
from autopar.passes.precision import describe as describe_precision
from autopar.passes.precision import mixed_precision
from autopar.passes.roll import Roll
from autopar.plan.plan import Plan, is_note
from autopar.search import first_tasks, search
from autopar.search.evaluate import memory_floor
from autopar.search.problem import Problem, build_problem, residency, step_floor
from autopar.sharding import Spec, mesh_info

# Plans predicted to use more than this fraction of the budget are compiled once on
# the mesh (when it has devices) and judged by XLA's memory analysis, because the
# liveness estimate does not see XLA's own temporaries.
COMPILE_CHECK_FRACTION = 0.7
log = logging.getLogger("autopar")
T = TypeVar("T")


@dataclass(frozen=True)
class _Found:
    """What the search of every try found: the plans ranked by step time (step_s, mesh
    index, engine name, mesh, problem, result, pipeline), why the tries left out have
    none, whether the memory budget turned one away, and the notes on the tries left out
    unsearched (by the floor, the screen, the remat policies before)."""

    ranked: list
    failures: list[str]
    memory_bound: bool
    notes: tuple[str, ...] = ()


def _searched(
    problem: Problem,
    engine: str,
    budget: float,
    pins: dict[int, int],
    clock,
    checked: bool,
    first: dict | None = None,
    seeds: dict | None = None,
):
    """`search`, or the MemoryBudgetError it raises when no plan fits, as a value.
    `checked`: plans near the budget will be compiled to check their memory, so the
    search keeps leaner ones behind them."""
    sure_fit = COMPILE_CHECK_FRACTION if checked else 1.0
    try:
        return search(problem, engine, budget, pins, clock, sure_fit, first, seeds)
    except MemoryBudgetError as e:
        return Infeasible(e)


class _Driver(Realizing, PipelineTries):
    """One remat policy's tries for one call."""

    def __init__(
        self,
        options: Options,
        call: Call,
        remat_policy: str | None,
        graph: Graph | None = None,  # the function traced on the call's arguments
        clock: Clock | None = None,
        remat_layers: int | None = None,  # of an unrolled stack, remat only the first ones
        traces: dict | None = None,  # micro-batch traces, full-size rolls: the call's
        bound: float = float("inf"),  # a made plan's step time (another remat policy's)
        earlier: Earlier | None = None,  # what the remat policies before this one found
    ):
        self.o, self.call, self.remat_policy = options, call, remat_policy
        # plans no faster than `bound` cannot be the one returned: not compiled to check
        # their memory (`_first_that_fits`)
        self.bound, self.earlier = bound, earlier or Earlier()
        given = options.given_plan
        if remat_layers is None and given is not None and remat_policy == given.remat:
            remat_layers = given.remat_layers
        self.remat_layers = remat_layers
        self.stack_layers = 0  # depth of the unrolled stack remat found (`_prepare`)
        self.unpipelined_fits = False  # a try without a pipeline gave a plan (`compile`)
        self.single = len(options.meshes) == 1
        self.name = fn_name(options.fn)
        self.graph, self.clock = graph, clock or Clock()
        self._rolled: dict = {}  # (stages, priced on one loop, virtual) -> `_looped`
        # a roll's ("full-size roll", loop steps, resident) -> (the rolled graph
        # rematerialized, the remat's notes)
        self._rolled_remat: dict[tuple, tuple[Graph, tuple[str, ...]]] = {}
        self.base: Graph | None = None  # the trace before remat (`compile`)
        self.traces: dict = {} if traces is None else traces  # `PipelineTries._pipelined`
        self._floors: dict = {}  # `_memory_floor`
        self._first: dict[int, dict] = {}  # screened shapes' first searches (`firsts_ahead`)

    def _capture(self, args: tuple, mesh=None) -> Graph:
        """Trace the function on `args` under `mesh` (default: the mesh, when there is
        only one)."""
        o = self.o
        mesh = mesh if mesh is not None else o.meshes[0] if self.single else None
        return capture(o.fn, args, self.call.static, mesh, o.keywords)

    def _info(self, mesh):
        return mesh_info(mesh, self.o.profile.devices_per_node)

    def _prepare(self, graph: Graph) -> tuple[Graph, tuple[str, ...]]:
        """The passes every trace goes through before search: mixed precision, remat.
        Returns the graph and the notes for the plan."""
        graph, notes = self._precision(graph)
        graph, more = self._remat(graph)
        return graph, notes + more

    def _precision(self, graph: Graph) -> tuple[Graph, tuple[str, ...]]:
        notes: tuple[str, ...] = tuple(
            f"layer stack: {s.describe()} (unrolled in Python)" for s in self._stacks(graph)
        )
        if self.o.precision is not None:
            on_cpu = drops_barriers(self.o.meshes[0])  # (a CPU mesh)
            notes += describe_precision(graph, self.o.precision).notes(on_cpu)
            graph = mixed_precision(graph, self.o.precision)
        return graph, notes

    def _remat(self, graph: Graph) -> tuple[Graph, tuple[str, ...]]:
        if self.remat_policy in (None, "none"):
            return graph, ()
        graph, report = self._rematerialize(graph, self.remat_layers)
        self.stack_layers = report.stack_layers if report.applied else 0
        if len(report.layers) >= report.stack_layers:
            self.remat_layers = None  # every layer of the stack (or there is none)
        if not report.applied:  # the plan records what was applied: nothing
            if self.o.remat != "auto":
                warnings.warn(
                    f"autopar: {self.name}: remat={self.remat_policy!r} has nothing to "
                    f"rematerialize ({report.why_nothing()}); the plan records remat=None",
                    stacklevel=user_level(),
                )
            self.remat_policy = None
        return graph, report.notes()

    def compile(self) -> Compiled | Infeasible:
        """The fastest plan over the meshes and pipelines, compiled; Infeasible when no
        mesh gives a plan: nothing fits the memory budget (more remat may help), or
        every mesh fails for another reason (`Infeasible.memory` tells them apart).
        Raises the user's other errors, and any error of the only option there is."""
        o = self.o
        if self.graph is None:
            log.info("tracing %s", self.name)
            with self.clock.phase("capture"):
                self.graph = self._capture(self.call.args)
        with self.clock.phase("passes"):
            self.base, notes = self._precision(self.graph)  # a pipeline may roll its layers
            graph, more = self._remat(self.base)
            notes += more
            if o.grad_accumulation and o.grad_accumulation > 1:
                graph, said = self._accumulated(graph)
                for why in (w for w in said if not is_note(w)):
                    warnings.warn(f"autopar: {self.name}: {why}", stacklevel=user_level())
                notes += said
        reused: dict[int, Spec] = {}
        if o.given_plan is not None:
            mesh = mesh_for_plan(o.meshes, o.given_plan)
            looped, rolled = graph, None
            rolled_json = (o.given_plan.pipeline or {}).get("rolled")
            if rolled_json:  # made on the rolled layers
                v = rolled_json.get("virtual_stages", 1)
                got = self._looped(graph, o.given_plan.pipeline["stages"], mesh, virtual=v)
                if isinstance(got, Infeasible):
                    raise got.error
                looped, rolled = got
            mismatch = plan_mismatch(o.given_plan, looped, self._info(mesh))
            if mismatch is None:
                plan = attach(o.given_plan, looped, mesh, graph)
                return self._replay(looped, plan, mesh, rolled)
            if not o.allow_partial:
                raise PlanError(mismatch)
            reused = reusable_specs(o.given_plan, graph, self._info(mesh))
        found = self._search(graph, reused)
        if isinstance(found, Infeasible):
            return found
        self.unpipelined_fits = any(pipeline_of(r[6]) is None for r in found.ranked)
        if o.pipeline_stages == "auto":
            one = next((r[6].roll.layers for r in found.ranked if proxied(r[6])), 0)
            notes += (
                pipeline_tries(found.ranked, found.failures, o.pipeline_schedule is None, one),
            )
            stage = [m for m in o.meshes if "stage" in m.axis_names]
            piped = any(pipeline_of(r[6]) is not None for r in found.ranked)
            if stage and not piped:  # no pipeline could be made: say why
                why = no_pipeline_why(found.failures)
                warnings.warn(f"autopar: {self.name}: {why}", stacklevel=user_level())
                notes += (why,)
        notes += found.notes
        lead = ()  # the plan's first warning
        if o.given_plan is not None:
            lead = (
                f"partial reuse of a plan for {o.given_plan.function or '?'}: kept the specs "
                f"of {len(reused)} of {len(graph.inputs)} arguments whose path, shape and dtype "
                "match; searched everything else afresh",
            )
        return self._first_that_fits(graph, found, notes, lead)

    def _tries(self, graph: Graph) -> tuple[list, list[str], list[type]]:
        """Every (mesh index, mesh, pipeline) to search, why the meshes left out have
        none and the class of each such error. Raises the error of the only mesh when
        it has none."""
        tries, failures, kinds = [], [], []
        for k, mesh in enumerate(self.o.meshes):
            pipes = self._pipelines(graph, mesh)
            if isinstance(pipes, Infeasible):
                if self.single:
                    raise pipes.error
                failures.append(f"{dict(zip(mesh.axis_names, mesh.axis_sizes))}: {pipes.why}")
                kinds.append(type(pipes.error))
                continue
            tries += [(k, mesh, p) for p in pipes]
        return tries, failures, kinds

    def _search(self, graph: Graph, reused: dict[int, Spec]) -> _Found | Infeasible:
        """Search every try, cheapest floor first (then cheapest screen, `_screen`); on an
        abstract mesh (no compile check can turn plans away afterwards) a try whose
        floor is above the best price found (or made by `remat="auto"`'s policies before)
        is skipped, on any mesh a screened try whose screen price is above SCREEN_MARGIN x
        the best price found, and a try the policies before rule out. Infeasible
        when no try gives a plan within the memory budget. Where `search.workers`
        allows, the tries are searched side by side first (`compile.tries.ahead`); this
        walk then takes their results in its own order, to the same decisions."""
        o = self.o
        tries, failures, kinds = self._tries(graph)
        floors = [  # under the faster schedule a try may also be priced in (`_rescheduling`)
            step_floor(
                graph_of(graph, p), mesh.size, o.profile, self._rescheduling(p) or pipeline_of(p)
            )
            for _, mesh, p in tries
        ]
        screen, built, same = self._screen(graph, tries, reused)
        ranked, best, skipped, memory_bound, dropped = [], math.inf, 0, False, []
        order = sorted(range(len(tries)), key=lambda i: (floors[i], screen.get(i, 0.0), i))
        abstract = [isinstance(mesh, AbstractMesh) for _, mesh, _ in tries]

        def floored(i: int, best: float) -> bool:  # its FLOP floor cannot beat `best`
            return abstract[i] and floors[i] >= min(best, self.earlier.best)  # (or theirs)

        def screened_out(i: int, best: float) -> bool:  # past the screen's margin
            return screen.get(i, 0.0) > SCREEN_MARGIN * best

        earlier = self.earlier  # what the remat policies before this one rule out
        settled = earlier.settled(tries, floors, self.remat_policy)

        def pruned(i: int, best: float) -> bool:  # the walk's rules below, as one test
            return i in same or i in settled or floored(i, best) or screened_out(i, best)

        def one(step: int, i: int):
            return self._try(graph, tries, i, step, built, reused)

        found = ahead(graph, tries, order, one, pruned, self.clock)
        shape = lambda i: self._info(tries[i][1])  # noqa: E731
        self._first = {} if found or not screen else firsts_ahead(
            order, screen, built, pruned, self.o.memory_budget, self.clock, len(graph.nodes),
            build=lambda i: self._built(graph, shape(i), None),
            tasks_of=lambda problem: self._first_tasks(problem, reused),
            name=lambda i: str(shape(i).shape),
        )  # fmt: skip
        left: list[int] = []  # not searched: the time limit came first
        for step, i in enumerate(order):
            k, mesh, pipelined = tries[i]
            if i in same or i in settled:
                continue
            if floored(i, best):
                skipped += 1
                continue
            if screened_out(i, best):
                dropped += [i] if math.isfinite(screen[i]) else []  # else: out of time
                continue
            if ranked and self.clock.out_of_time() and i not in found:
                left.append(i)  # (a worker's result, searched already, is still taken)
                continue
            got = found.pop(i) if i in found else one(step, i)
            if isinstance(got, str):  # its memory floor is over the budget
                failures.append(got)
                if len(tries) == 1:
                    return Infeasible(MemoryBudgetError(got))
                memory_bound = True
                continue
            problem, result, other = got
            zb, policy = self._rescheduling(pipelined), self.remat_policy
            earlier.add(tries[i], bound(result, other, zb), floors[i], policy)
            problem = problem or built.pop(i, None)  # None: searched in a worker
            if isinstance(result, Infeasible):
                if len(tries) == 1:
                    if result.memory:
                        return result
                    raise result.error
                failures.append(f"{self._info(mesh).shape}: {result.brief}")
                kinds.append(type(result.error))
                memory_bound |= result.memory
                continue
            ranked += self._entries(k, mesh, problem, result, pipelined, other)
            best = min([best] + [cost.step_s for _, _, cost in (*result.ranked, *other)])
        if left:
            self.clock.skip(left_out(tries, left, self.remat_policy))
        said = [floored_note(skipped, len(tries))] if skipped else []
        said += [earlier.note(settled, tries, self.remat_policy)] if settled else []
        if not ranked:  # (or every try left out by the remat policies before: not memory)
            why = "\n  ".join(grouped(failures + said, "}: ", kept="}"))
            if memory_bound or said:
                return Infeasible(
                    MemoryBudgetError("no mesh shape gives a plan that fits:\n  " + why)
                )
            # nothing was held back by memory: the meshes' own errors, of their one class
            kind = kinds[0] if len(set(kinds)) == 1 else AutoparError
            return Infeasible(kind(f"{self.name}: no mesh shape can run this step:\n  " + why))
        ranked.sort(key=lambda r: r[:3])
        if dropped or same:
            said.insert(0, screen_note(tries, screen, dropped, same, best, SCREEN_MARGIN))
        return _Found(ranked, failures, memory_bound, tuple(said))

    def _try(self, graph: Graph, tries: list, i: int, step: int, built: dict, reused: dict):
        """Try `i` searched: (its problem, the search's result or Infeasible), or the
        note saying its memory floor is over the budget (it is then not built); with
        its first searches' results where they ran side by side (`firsts_ahead`)."""
        o = self.o
        _, mesh, pipelined = tries[i]
        info, g, pipe = self._info(mesh), graph_of(graph, pipelined), pipeline_of(pipelined)
        # not worth building when no plan of it can fit (the only try of a call that
        # is not `remat="auto"` is searched: its error names the largest tensors)
        floored = len(tries) > 1 or o.remat == "auto"
        need = self._memory_floor(g, mesh.size, pipe) if floored else 0
        if need > o.memory_budget:
            return over_floor(try_name(info.shape, pipe), need, o.memory_budget)
        log.info(
            "mesh %s: pricing the strategies of %d ops",
            try_name(info.shape, pipe),
            len(g.nodes),
            extra={"autopar_step": (step + 1, len(tries))},
        )
        problem = built.pop(i, None) or self._built(g, info, pipe)
        return self._searched_try(problem, mesh, pipelined, reused, i)

    def _searched_try(
        self, problem: Problem, mesh, pipelined, reused: dict, i: int | None = None
    ) -> tuple:
        """A try's built problem searched: (problem, the result or Infeasible, the plans
        under the other schedule, `_other_schedule`). `i`: its index, for the first
        searches made side by side (`firsts_ahead`)."""
        o = self.o
        pins = self._pins(problem, pipelined if problem.graph is not self.graph else None, reused)
        if isinstance(pins, MeshError):
            return problem, Infeasible(pins), ()
        checked = isinstance(mesh, Mesh)
        first = self._first.get(i) if i is not None else None
        # a mesh's plans with its axes merged are candidates too (`merged`)
        seeded = o.engine == "auto" and not pins and pipelined is None
        seeds = merged_seeds(problem.graph, problem) if seeded else None
        result = _searched(
            problem, o.engine, o.memory_budget, pins, self.clock, checked, first, seeds
        )
        return problem, result, self._other_schedule(problem, pipelined, result)

    def _memory_floor(self, g: Graph, devices: int, pipelined) -> float:
        """`memory_floor` of a try's graph, once per (graph, device count, pipeline):
        the shapes of a mesh-shape search share it (0.3 s each on a 58k-op graph)."""
        key = (id(g), devices, id(pipelined))
        if key not in self._floors:
            self._floors[key] = memory_floor(g, devices, residency(g, pipelined))
        return self._floors[key]

    def _built(self, g: Graph, info, pipelined) -> Problem:
        with self.clock.phase("build"):
            problem = build_problem(g, info, CostModel(self.o.profile, info), pipelined)
        if self.call.donate:  # by path: a rolled graph's grouped leaves are not matched
            paths = {self.graph.input_paths[i] for i in self.call.donate}
            donated = frozenset(k for k, p in enumerate(g.input_paths) if p in paths)
            problem = replace(problem, donated=donated)
        # its tables stay while it is searched, most of them for the whole planning:
        # left out of the full collections the search's garbage triggers, as the
        # capture is (`compile.step.compile_step`, which puts them back at the end)
        gc.freeze()
        return problem

    def _pins(self, problem: Problem, rolled, reused: dict[int, Spec]):
        """The user's `in_specs=` and a reused plan's specs as pins on `problem`'s
        arguments, or the MeshError saying why they cannot apply. `rolled`: the try's
        pipeline where its graph is the step's layers rolled into loops (`passes.roll`),
        whose pins then say how each stage holds its layers' leaves."""
        call, pins, pipe = self.call, {}, pipeline_of(rolled)
        if call.in_specs is not None:  # (a `OneLoop` is not tried with in_specs=)
            roll, axis = (pipe.roll, pipe.pipe.axis) if pipe is not None else (None, "")
            pins = user_pins(problem, call.dyn, call.in_specs, roll, axis)
        if not isinstance(pins, MeshError):
            pins.update(spec_pins(problem, reused))
        return pins

    def _screen(self, graph: Graph, tries: list, reused: dict[int, Spec]):
        """`compile.screen.screen` of this call's tries without a pipeline (not for an
        engine as cheap as the screen, or a device count whose memory floor is over the
        budget): a pipeline's tries are searched in full, its shapes without one screened
        beside them."""
        o = self.o
        plain = [i for i, (_, _, p) in enumerate(tries) if p is None]
        # every shape has the same devices, so the same memory floor: over the budget, no
        # shape can fit, and the walk drops each unbuilt (`_try`) without a screen
        if (
            len(plain) < 2
            or o.engine in ("recursive", "propagate")
            or self._memory_floor(graph, tries[0][1].size, None) > o.memory_budget
        ):
            return {}, {}, {}
        build = lambda info: self._built(graph, info, None)  # noqa: E731
        pins = lambda problem: self._pins(problem, None, reused)  # noqa: E731
        return screen(graph, tries, self.clock, self._info, build, pins, o.memory_budget, plain)

    def _first_tasks(self, problem: Problem, reused: dict) -> dict:
        """`search.first_tasks` of a screened shape's problem ({} where its pins fail:
        the walk's search of it says why)."""
        pins = self._pins(problem, None, reused)
        if isinstance(pins, MeshError):
            return {}
        return first_tasks(problem, self.o.engine, self.o.memory_budget, pins, self.clock)

    def _first_that_fits(
        self, graph: Graph, found: _Found, notes: tuple[str, ...], lead: tuple[str, ...]
    ) -> Compiled | Infeasible:
        """The fastest plan found, compiled once on a mesh with devices when it comes
        close to the budget (by its prediction times the most XLA's figure has exceeded
        one by so far); the next one when XLA needs more than the budget."""
        o, call = self.o, self.call
        rejected, slower, under = [], 0, 1.0
        for n, (step_s, _, name, mesh, problem, result, pipelined) in enumerate(found.ranked):
            if proxied(pipelined):  # priced on the one-loop roll: searched again as it runs
                rest = replace(found, ranked=found.ranked[n:])
                realize = partial(self._realized, graph, rest, notes, lead)
                remat = self.remat_policy if self.remat_policy != "none" else None
                return Proxy(step_s, found.memory_bound or bool(rejected), remat, realize)
            if problem is None:  # searched in a worker (`compile.tries`): built again here
                problem = self._built(graph_of(graph, pipelined), self._info(mesh), pipelined)
            with self.clock.phase("plan"):
                plan = make_plan(problem, result.pick(name), o.profile, mesh, pipelined, graph)
                plan = replace(
                    plan,
                    precision=o.precision,
                    grad_accumulation=o.grad_accumulation,
                    remat=self.remat_policy if self.remat_policy != "none" else None,
                    remat_layers=self.remat_layers if self.remat_policy else None,
                    memory_budget=o.memory_budget,
                    donate_argnums=tuple(o.donate_argnums),
                    warnings=(*notes, *plan.warnings),
                )
                g, rolled = graph_of(graph, pipelined), roll_of(pipelined)
                donate = rolled.donated(call.donate) if rolled else call.donate
                stacks = self._stacks(graph) if rolled else []
                for why in plan_warnings(graph, plan, o, pipelined, mesh, stacks):
                    warnings.warn(f"autopar: {self.name}: {why}", stacklevel=user_level())
                    plan = replace(plan, warnings=(*plan.warnings, why))
                if rolled is not None:  # remat ran on the rolled loops, not the layers
                    kept = [w for w in plan.warnings if not w.startswith("remat (")]
                    shared = ("full-size roll", rolled.stages, rolled.resident)
                    done = self._rolled_remat.get(shared, (None, ()))[1]
                    plan = replace(plan, warnings=(*kept, rolled.describe(), *done))
                jitted = jit_from_plan(g, plan, mesh, donate, pipelined)
            peak = plan.cost.peak_memory_bytes
            if isinstance(mesh, Mesh) and peak * under > COMPILE_CHECK_FRACTION * o.memory_budget:
                if step_s >= self.bound:  # this and every plan after it (ranked by time)
                    slower = len(found.ranked) - n
                    break
                log.info("compiling %s to check its memory", info_str(plan))
                with self.clock.phase("compile check"):
                    flat = abstract_inputs(rolled, call.flat) if rolled else call.flat
                    compiled = compiled_memory(lowered(jitted, flat, plan, mesh).compile())
                plan = replace(plan, compiled_memory_bytes=compiled)
                under = max(under, compiled / max(peak, 1))
                if compiled > o.memory_budget:
                    rejected.append(f"{info_str(plan)}: compiled {format_bytes(compiled)}")
                    continue
            elif peak > COMPILE_CHECK_FRACTION * o.memory_budget:
                why = offline_warning(plan, o.memory_budget)
                warnings.warn(f"autopar: {self.name}: {why}", stacklevel=user_level())
                plan = replace(plan, warnings=(*plan.warnings, why))
            if rejected:
                plan = replace(
                    plan,
                    warnings=plan.warnings
                    + tuple(f"rejected after compiling: {r}" for r in rejected),
                )
            plan = replace(plan, warnings=(*lead, *plan.warnings))
            whole = unsplittable(problem, self.name)
            if whole:  # of the plan returned, once
                warnings.warn(f"autopar: {whole}", stacklevel=user_level())
                plan = replace(plan, warnings=(*plan.warnings, whole))
            held = held_back(plan, o.memory_budget)
            memory_bound = found.memory_bound or bool(rejected) or "+zero" in plan.engine or held
            return Compiled(g, plan, problem, jitted, mesh, memory_bound, rolled)
        budget = format_bytes(o.memory_budget)
        head = f"every plan the cost model fit into {budget} needs more once compiled by XLA:"
        if slower:
            made = f"{self.bound * 1e3:.4g} ms, a plan already made"
            if not rejected:
                head = f"no plan the cost model fit into {budget} is faster than {made}:"
            rejected.append(f"{slower} plan(s) no faster than {made}, not compiled")
        return Infeasible(
            MemoryBudgetError(f"{head}\n  " + "\n  ".join(rejected) + f"\n{BUDGET_HINT}")
        )

    def _replay(self, graph: Graph, plan: Plan, mesh, rolled: Roll | None = None) -> Compiled:
        """The given plan, bound to this trace, as it is (no search)."""
        pipelined = None
        if plan.pipeline:
            pipe = Pipeline.from_json(plan.pipeline)
            pipelined = self._pipelined(graph, pipe, mesh, rolled)
            if isinstance(pipelined, Infeasible):
                raise pipelined.error
        donate = rolled.donated(self.call.donate) if rolled else self.call.donate
        with self.clock.phase("plan"):
            jitted = jit_from_plan(graph, plan, mesh, donate, pipelined)
        return Compiled(graph, plan, None, jitted, mesh, roll=rolled)

    def _accumulated(self, graph: Graph) -> tuple[Graph, tuple[str, ...]]:
        """`graph` with its per-micro-batch part in a loop (`autopar.passes.accumulate`),
        and the pass's notes; the batch is the last non-static argument but PRNG keys
        (`accumulate.batch_argument`), cut along its leaves' leading dim."""
        M, name = self.o.grad_accumulation, self.name
        margs, batch = micro_batch_args(
            self.o.fn, self.call.args, self.call.static, len(self.o.keywords), M, name
        )
        log.info("tracing %s at the micro-batch size", name)
        try:
            micro, _ = self._prepare(self._capture(tuple(margs)))
        except CaptureError as e:
            why = batch_hint(self.o.fn, self.call.args, self.call.static, len(self.o.keywords), M)
            raise MicrobatchError(f"{e.message}\n{why}") from e
        mesh = self.o.meshes[0] if self.single else None
        return accumulate(graph, micro, batch, M, mesh)
