"""The pipelines a call can try (`_Driver`'s share): for each mesh with a stage axis,
the loop over layers to pipeline (a `scan`, or a stack unrolled in Python rolled into
loops by `autopar.passes.roll`), each micro-batch count, the function traced again at
the micro-batch size and paired with it; under `pipeline_stages="auto"`, a 1F1B try's
plans priced again under ZB-H1; and `Infeasible`, the value an option that gives no
plan turns into."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import jax

from autopar.compile.calls import OneLoop, pipeline_of
from autopar.compile.notes import grouped, no_layer_loop
from autopar.errors import AutoparError, MemoryBudgetError, MicrobatchError, PipelineError
from autopar.ir.graph import Graph, find_aliases
from autopar.meshes import drops_barriers
from autopar.passes.pipeline import (
    FUSED_SCHEDULES,
    Pipeline,
    PipelinedScans,
    batch_size,
    check_pipeline,
    feeding_carry,
    fuse,
    micro_args,
    pipelined_scans,
    scan_labels,
    with_full_consts,
)
from autopar.passes.remat import rematerialize
from autopar.passes.rescale import rescaled
from autopar.passes.roll import Roll, roll
from autopar.passes.stack_misses import why_no_stack
from autopar.passes.stack_pad import split_stacks, with_trims
from autopar.passes.stacks import find_stacks
from autopar.search.build import Problem
from autopar.search.evaluate import evaluate
from autopar.search.piped import rescheduled

log = logging.getLogger("autopar")
T = TypeVar("T")


@dataclass(frozen=True)
class Infeasible:
    """Why an option (a remat policy, a mesh, a pipeline, a micro-batch count) gives no
    plan: the error the user gets when it was the only one to try."""

    error: AutoparError

    @property
    def why(self) -> str:
        return self.error.message

    @property
    def brief(self) -> str:
        """`why`'s first line, with the list it introduces (a first line ending in ":",
        such as the plans rejected after compiling) joined on, not cut off."""
        lines = self.why.splitlines()
        if not lines or not lines[0].endswith(":"):
            return lines[0] if lines else ""
        items = [ln.strip() for ln in lines[1:] if ln.startswith(" ")]
        return f"{lines[0]} {'; '.join(items)}"

    @property
    def memory(self) -> bool:
        return isinstance(self.error, MemoryBudgetError)


def _applies(fn: Callable[..., T], *args) -> T | Infeasible:
    """`fn(*args)` of a pass that raises the user's error where a pipeline or a
    micro-batch count does not fit the step (naming the op): that error as a value."""
    try:
        return fn(*args)
    except (PipelineError, MicrobatchError) as e:
        return Infeasible(e)


class PipelineTries:
    """The pipeline half of `compile.driver._Driver` (which sets the attributes read
    here: options `o`, `call`, `name`, `clock`, the trace before remat `base`, the remat policy
    and layer count, `_rolled`/`_rolled_remat`, the rolled stacks per stage count, and
    `traces`, the micro-batch traces and the full-size rolls every remat policy's driver
    of the call shares)."""

    def _per_trace(self, what: str, graph: Graph, fn: Callable[[Graph], T]) -> T:
        """`fn(graph)`, once per trace for all the call's drivers (`traces`): the stacks
        (`find_stacks`, about a second on a 96-layer step, asked for by every stage
        count and remat policy), whether the step constrains shardings."""
        key = (what, id(graph))
        if key not in self.traces:  # (the graph kept with it: its id stays its own)
            self.traces[key] = (graph, fn(graph))
        return self.traces[key][1]

    def _stacks(self, graph: Graph) -> list:
        return self._per_trace("stacks", graph, find_stacks)

    def _entries(self, k: int, mesh, problem, result, pipelined, other) -> list[tuple]:
        """A searched try's plans as `_Found.ranked` entries, with the same plans under
        ZB-H1 (`other`, `_other_schedule`)."""
        out = [
            (c.step_s, k, name, mesh, problem, result, pipelined) for name, _, c in result.ranked
        ]
        if other:
            zb = self._rescheduling(pipelined)
            zb_problem = rescheduled(problem, zb) if problem is not None else None
            zb_result = replace(result, ranked=other)
            out += [(c.step_s, k, name, mesh, zb_problem, zb_result, zb) for name, _, c in other]
        return out

    def _remat_rolled(self, graph: Graph) -> tuple[Graph, tuple[str, ...]]:
        """A rolled graph's loops rematerialized as scans are (`_looped`), and the notes;
        the step's other stacks unrolled in Python too, if it has any."""
        if self.remat_policy in (None, "none"):
            return graph, ()
        others = len(self._stacks(self.base)) > 1
        graph, report = self._rematerialize(graph, unrolled=others)
        return graph, report.notes()

    def _rematerialize(self, graph: Graph, layers: int | None = None, unrolled: bool = True):
        """`passes.remat.rematerialize` under this call's policy; where the mesh's
        compiler drops optimization barriers (XLA:CPU) unrolled layers are ordered by
        data (`wait_for_gradients`)."""
        wait = drops_barriers(self.o.meshes[0])
        return rematerialize(graph, self.remat_policy, layers, unrolled, wait_for_gradients=wait)

    def _pipelines(self, graph: Graph, mesh) -> list[PipelinedScans | None] | Infeasible:
        """The pipelines to try on `mesh`: none, or `pipeline_stages` with each candidate
        micro-batch count (`microbatches`, else S, 2S and 4S where they cut the batch);
        Infeasible when `mesh` or the step allows none."""
        o = self.o
        if o.pipeline_stages is None:
            return [None]
        S = o.pipeline_stages
        if S == "auto":  # one candidate mesh of `pipeline_meshes`: its stage axis
            if "stage" not in mesh.axis_names:
                return [self._unpipelined(graph, mesh)]
            S = dict(zip(mesh.axis_names, mesh.axis_sizes))["stage"]
        checked = _applies(check_pipeline, Pipeline(S, 1), self._info(mesh))
        if isinstance(checked, Infeasible):
            return checked
        v = o.virtual_stages
        looped = self._looped(graph, S, mesh, virtual=v)
        if isinstance(looped, Infeasible):
            return looped
        graph, rolled = looped
        if v > 1 and not pipelined_scans(graph, Pipeline(S, 1, "interleaved", virtual=v)):
            lengths = [
                graph.nodes[i].params["length"] for i in pipelined_scans(graph, Pipeline(S, 1))
            ]
            return Infeasible(
                PipelineError(
                    f"{self.name}: pipeline_schedule='interleaved' with {v} virtual stages on "
                    f"{S} stages: no layer loop's length ({sorted(set(lengths))}) splits into "
                    f"{S} stages x {v} chunks"
                )
            )
        scans = pipelined_scans(graph, Pipeline(S, 1))
        if not scans:  # rolled, but no layer hands a batched value on to the next
            return Infeasible(
                PipelineError(
                    f"{self.name}: pipeline_stages={S}: "
                    + (f"the layers of {rolled.template} " if rolled is not None else "the layers ")
                    + "do not hand an activation on from layer to layer (no loop over them "
                    "carries a value with a batch dim), so stages would have nothing to pass "
                    "each other; pipelining needs layers that feed each other"
                )
            )
        batch = batch_size(graph, scans)
        counts = (
            [o.microbatches]
            if o.microbatches is not None
            else [m for m in (S, 2 * S, 4 * S, 8 * S, 12 * S) if batch % m == 0]
        )
        if not counts or counts == [1]:  # one micro-batch: the stages would run in turn
            why = (
                f"a batch of {batch} examples does not split into {S}, {2 * S}, {4 * S}, "
                f"{8 * S} or {12 * S} micro-batches"
                if not counts
                else "microbatches=1 gives its stages nothing to overlap: each would wait "
                "for the one before"
            )
            return Infeasible(
                PipelineError(
                    f"{self.name}: {S} stages: {why}; give microbatches= a count of at least "
                    f"2 that divides the batch ({S} or more keeps every stage busy)"
                )
            )
        out, skipped = [], []
        for m in counts:
            pipe = Pipeline(S, m, o.pipeline_schedule or "1f1b", virtual=o.virtual_stages)
            got = self._pipelined(graph, pipe, mesh, rolled)
            if not isinstance(got, Infeasible):
                out.append(got)
            elif o.microbatches is not None:
                return got
            else:  # e.g. a batch of 1 traces to different ops
                skipped.append(f"{m}{MICRO}{got.why}")
        if not out:
            lines = "\n  ".join(grouped(skipped, MICRO))
            return Infeasible(PipelineError("no micro-batch count works:\n  " + lines))
        return out

    def _unpipelined(self, graph: Graph, mesh) -> OneLoop | None:
        """`pipeline_stages="auto"`'s try without a pipeline on `mesh`: where the step's
        layers are unrolled in Python and the pipeline tries are priced on them rolled
        into one loop (`_one_loop`), a `OneLoop` priced the same way (the 96-layer
        GPT-3 step's such try was 58k ops, 55 CPU-s, against 4 s for any scanned try);
        None (the step as it is) otherwise."""
        o = self.o
        if (
            not self._one_loop()
            or self.call.in_specs is not None  # pins the user's leaves, not the roll's
            or (o.grad_accumulation or 1) > 1
            or self.remat_layers is not None
            or not self._stacks(self.base)
        ):
            return None
        got = self._looped(graph, 1, mesh, proxy=True)
        if isinstance(got, Infeasible) or got[1] is None:
            return None
        return OneLoop(*got)

    def _rescheduling(self, pipelined):
        """The ZB-H1 form of a lock-step 1F1B try whose plans `_other_schedule` prices
        again (`pipeline_stages="auto"`, no schedule asked for); None otherwise."""
        o, pipelined = self.o, pipeline_of(pipelined)
        if (
            o.pipeline_stages != "auto"
            or o.pipeline_schedule is not None
            or pipelined is None
            or pipelined.pipe.schedule != "1f1b"
            or not pipelined.fused
        ):
            return None
        return replace(pipelined, pipe=replace(pipelined.pipe, schedule="zb-h1"))

    def _other_schedule(self, problem: Problem, pipelined, result) -> tuple:
        """With `pipeline_stages="auto"` and no schedule asked for, the plans a lock-step
        1F1B try found priced again under ZB-H1 (`search.piped.rescheduled`: the same
        layouts with the weight gradients deferred; faster, holding more), those that
        fit the budget, as `SearchResult.ranked` entries; () otherwise. A re-pricing,
        not a search: the best ZB-H1 plan may lay things out otherwise."""
        o = self.o
        zb = self._rescheduling(pipelined)
        if zb is None or isinstance(result, Infeasible):
            return ()
        with self.clock.phase("evaluate"):
            other = rescheduled(problem, zb)
            priced = [(name, choice, evaluate(other, choice)) for name, choice, _ in result.ranked]
        return tuple(r for r in priced if r[2].peak_memory_bytes <= o.memory_budget)

    def _one_loop(self) -> bool:
        """Whether the pipeline tries on a stack unrolled in Python are priced on the
        stack rolled into one loop over all its layers (`proxy`): where there is more
        than one try to rank (several stage counts, micro-batch counts or remat
        policies); the fastest is then rolled for its stages and searched again
        (`_realized`)."""
        o = self.o
        return o.given_plan is None and (
            o.pipeline_stages == "auto" or o.microbatches is None or o.remat == "auto"
        )

    def _scans_in_layers(self, S: int) -> bool:
        """Whether every scan `S` stages would pipeline runs inside a layer of a stack
        unrolled in Python (a recurrence over time in each layer, `lax.scan` in an RNN
        or SSM block): the stack is the loop over layers, not those scans."""
        scans = pipelined_scans(self.base, Pipeline(S, 1))
        stacks = self._stacks(self.base)
        inside = {i for s in stacks for b in (*s.forward, *s.backward) for i in b.nodes}
        return bool(scans) and all(i in inside for i in scans)

    def _looped(
        self, graph: Graph, S: int, mesh, proxy: bool | None = None, virtual: int = 1
    ) -> tuple[Graph, Roll | None] | Infeasible:
        """The graph whose loops `S` stages pipeline: `graph` when a scan over layers
        splits into `S`, else `graph` with its stack of layers unrolled in Python rolled
        into loops (`autopar.passes.roll`) and the `Roll`; Infeasible when neither.
        `proxy` (default `_one_loop()`): rolled into one loop over all the stack's layers,
        whose one-layer bodies (a scanned model's) the try is priced on, instead of one
        loop step per stage (what runs). `virtual` > 1 (the interleaved schedule): one
        step per chunk of a stage, the groups stored in chunk order."""
        if pipelined_scans(graph, Pipeline(S, 1)) and not self._scans_in_layers(S):
            return graph, None
        proxy = self._one_loop() if proxy is None else proxy
        key = (S, proxy, virtual)  # the rolled ops do not depend on the mesh's shape
        if key not in self._rolled:
            # the stack is found and rolled before remat (its copies would sit between
            # the layers); the rolled loops are then rematerialized as scans are
            base = self.base
            stacks = self._stacks(base)
            fits = [s for s in with_trims(stacks) if len(s.forward) % (S * virtual) == 0]
            fits = fits or split_stacks(stacks, S * virtual, self.o.pipeline_stages == "auto")
            if self.remat_layers is not None:
                self._rolled[key] = Infeasible(
                    PipelineError(
                        f"{self.name}: remat on the first {self.remat_layers} layers only does "
                        "not apply to a pipelined stack (its stages run one loop body)"
                    )
                )
            elif fits:
                # the roll itself is the same for every remat policy: made once per call
                chunks = len(fits[0].forward) if proxy else S * virtual
                resident = (S, virtual) if virtual > 1 else None
                shared = ("full-size roll", chunks, resident)
                with self.clock.phase("passes"):
                    if shared not in self.traces:
                        self.traces[shared] = _applies(roll, base, fits[0], chunks, mesh, resident)
                    got = self.traces[shared]
                    if not isinstance(got, Infeasible):  # rematerialized once per roll
                        if shared not in self._rolled_remat:  # (every S of the one loop's)
                            self._rolled_remat[shared] = self._remat_rolled(got[0])
                        got = (self._rolled_remat[shared][0], got[1])
                if isinstance(got, Infeasible) and proxy:  # what runs may still roll
                    got = self._looped(graph, S, mesh, proxy=False, virtual=virtual)
                self._rolled[key] = got
            else:
                loops = [n.params["length"] for n in graph.nodes if n.body is not None]
                why = (
                    f"no scan's length ({loops}) is a multiple of {S}"
                    if loops
                    else "; ".join(
                        f"{s.named()} (unrolled in Python) do not "
                        + (
                            f"split into {S} stages x {virtual} chunks (interleaved: each "
                            "chunk needs as many layers; pick virtual_stages dividing the "
                            "layers per stage)"
                            if virtual > 1
                            else f"fill {S} stages (each needs a layer at least)"
                            if len(s.forward) < S
                            else f"split into {S} equal stages, nor do all but their first "
                            f"{len(s.forward) % S} under pipeline_stages='auto' (more than a "
                            "stage's worth would run outside the pipeline)"
                        )
                        + (f" ({s.why_left_out()})" if s.left_out else "")
                        for s in stacks
                    )
                    or no_layer_loop(why_no_stack(base))
                )
                head = (
                    f"{S} stages: "  # `notes.no_pipeline_why` groups the meshes by reason
                    if self.o.pipeline_stages == "auto"
                    else f"{self.name}: pipeline_stages={S} pipelines layers, but "
                )
                self._rolled[key] = Infeasible(PipelineError(head + why))
        return self._rolled[key]

    def _pipelined(
        self, graph: Graph, pipe: Pipeline, mesh, rolled: Roll | None = None
    ) -> PipelinedScans | Infeasible:
        """Capture the function again at the micro-batch size and pair its scans with
        `graph`'s pipelined ones (`rolled`: `graph` is the trace with its unrolled
        stack rolled into loops; so is the micro-batch trace); Infeasible where the
        step does not pipeline so."""
        checked = _applies(check_pipeline, pipe, self._info(mesh))
        if isinstance(checked, Infeasible):
            return checked
        scans = pipelined_scans(graph, pipe)
        name, args, static = self.name, self.call.args, self.call.static
        dyn, tree = jax.tree_util.tree_flatten(self.call.dyn)
        # state the step returns updated is not cut (a stack of 8 layers' weights is not
        # a batch of 8), but what feeds the loops' carry is the batch, whatever the step
        # returns (its final activations, the same type as its input)
        batch = batch_size(graph, scans)
        fed = feeding_carry(graph, scans, batch)
        keep = {
            p
            for i in find_aliases(graph).values()
            if i not in fed
            for p in (rolled.inputs[i] if rolled else [i])
        }
        flat = _applies(micro_args, dyn, batch, pipe.microbatches, name, keep)
        if isinstance(flat, Infeasible):
            return flat
        micro_dyn = iter(jax.tree_util.tree_unflatten(tree, flat))
        margs = tuple(a if i in static else next(micro_dyn) for i, a in enumerate(args))
        # one trace per set of micro-batch argument types (and mesh, where the step has
        # sharding constraints, which resolve against it), shared by the candidates and
        # the remat policies' drivers; one roll of it per stage count (the rolled ops
        # depend on neither the mesh's other axes nor the micro-batch count)
        shape = tuple(zip(mesh.axis_names, mesh.axis_sizes))
        by_mesh = self._per_trace(
            "constrains", self.base if self.base is not None else graph, _constrains
        )
        sig = tuple((getattr(x, "shape", None), str(getattr(x, "dtype", ""))) for x in flat)
        raw = ("trace", shape if by_mesh else None, sig)
        how = (rolled.stages, rolled.resident) if rolled is not None else None
        key = ("rolled", raw, how)
        # a try priced on the one-loop roll: its micro-batch graph derived from one
        # traced at another size, where `rescale` can (the plan's try is traced again)
        ref = ("reference", how) if rolled is not None and not by_mesh else None
        derive = ref is not None and proxied_roll(rolled, pipe) and batch >= 2 * pipe.microbatches
        if key not in self.traces and derive and ref in self.traces:
            full, (micro, count) = self.traces[("full-size roll", *how)], self.traces[ref]
            with self.clock.phase("passes"):
                got = rescaled(full[0], micro, count, pipe.microbatches)
            if got is not None:
                log.info(
                    "%s at %d micro-batches: derived from the trace at %d",
                    name,
                    pipe.microbatches,
                    count,
                )
                self.traces[key] = got
        if key not in self.traces:
            if raw not in self.traces:
                log.info("tracing %s at the micro-batch size", name)
                with self.clock.phase("capture"):
                    # under the mesh only where the step's constraints need it (and the
                    # key says so), else as the whole batch was traced: NNX's dropout
                    # under a mesh adds `reshard`s the whole-batch trace has not
                    self.traces[raw] = self._capture(margs, mesh if by_mesh else None)
            traced = self.traces[raw]
            if rolled is not None:
                with self.clock.phase("passes"):
                    traced = self._precision(traced)[0]
                    traced = _applies(_roll_like, traced, self._stacks(traced), rolled, mesh)
            self.traces[key] = traced
            if derive and not isinstance(traced, Infeasible):
                self.traces.setdefault(ref, (traced, pipe.microbatches))
        micro = self.traces[key]
        if isinstance(micro, Infeasible):
            return micro
        with self.clock.phase("passes"):
            micro = self._prepare(micro)[0] if rolled is None else self._remat_rolled(micro)[0]
        mscans = pipelined_scans(micro, pipe)
        if len(mscans) != len(scans):
            return Infeasible(
                PipelineError(
                    f"{name}: at the micro-batch size the function has {len(mscans)} pipelinable "
                    f"loops instead of {len(scans)}; pipelining needs the same loops at any batch size"
                )
            )
        bodies = {}
        for i, j in zip(scans, mscans):
            full_node, micro_node = graph.nodes[i], micro.nodes[j]
            loop = f"the scan at {full_node.key}"
            if rolled is not None:  # the user wrote layers, not a loop: name them
                loop = f"{rolled.named()} (unrolled in Python)"
            labels = _applies(scan_labels, full_node, micro_node, pipe.microbatches, loop)
            if isinstance(labels, Infeasible):
                return labels
            bodies[i] = (with_full_consts(micro_node.body, full_node.body), labels)
        extra = {"graph": graph, "roll": rolled} if rolled is not None else {}
        if pipe.schedule not in FUSED_SCHEDULES:
            return PipelinedScans(pipe, bodies, **extra)
        if scans != mscans:
            why = f"{name}: the captures at the two batch sizes do not line up"
        else:
            fused = _applies(fuse, graph, micro, bodies, pipe.microbatches)
            if isinstance(fused, Infeasible):
                why = fused.why
            elif not fused:
                why = f"{name}: no forward loop is followed by its backward loop"
            else:
                return PipelinedScans(pipe, bodies, fused, **extra)
        if self.o.pipeline_schedule in FUSED_SCHEDULES:
            return Infeasible(PipelineError(f"pipeline_schedule={pipe.schedule!r}: {why}"))
        log.info("1F1B does not apply (%s); GPipe", why)
        fallback = (
            f"the pipeline runs GPipe, not the default 1F1B ({why}): a stage holds every "
            "micro-batch's activations until its backward pass"
        )
        return PipelinedScans(replace(pipe, schedule="gpipe"), bodies, fallback=fallback, **extra)


MICRO = " micro-batches: "  # a micro-batch count's refusal: `{m}{MICRO}{why}`


def _constrains(graph: Graph) -> bool:
    """Whether the step has a sharding constraint (in a loop body or branch too)."""
    return any(
        n.op == "sharding_constraint"
        or (n.body is not None and _constrains(n.body))
        or any(_constrains(b) for b in n.branches or ())
        for n in graph.nodes
    )


def graph_of(graph: Graph, pipelined: PipelinedScans | OneLoop | None) -> Graph:
    """The graph a try searches: the rolled one when its pipeline (or `OneLoop`) rolled
    the layers."""
    return pipelined.graph if pipelined is not None and pipelined.graph is not None else graph


def roll_of(pipelined: PipelinedScans | None) -> Roll | None:
    return None if pipelined is None else pipelined.roll


def proxied(pipelined: PipelinedScans | OneLoop | None) -> bool:
    """Whether a try is priced on its unrolled stack rolled into one loop over all the
    layers (`PipelineTries._looped`'s `proxy`, `OneLoop`), not as it runs."""
    if isinstance(pipelined, OneLoop):
        return True
    roll = roll_of(pipelined)
    return roll is not None and proxied_roll(roll, pipelined.pipe)


def proxied_roll(roll: Roll, pipe: Pipeline) -> bool:
    """Whether `roll` has more loop steps than `pipe` runs chunks of layers."""
    return roll.stages != pipe.stages * pipe.virtual


def _roll_like(graph: Graph, stacks: list, like: Roll, mesh) -> Graph:
    """`graph` (the step traced again, at another batch size; `stacks`, its own) with
    the stack `like` rolled the same way."""
    split = [t for s in with_trims(stacks) if (t := s.split_into(like.stages)) is not None]
    for stack in [*with_trims(stacks), *split]:
        if stack.template == like.template and len(stack.forward) == like.layers:
            got, again = roll(graph, stack, like.stages, mesh, like.resident)
            if (again.inputs, again.outputs) == (like.inputs, like.outputs):
                return got
    raise PipelineError(
        f"{graph.name}: traced again, the step does not have the same {like.layers} layers of "
        f"{like.template}; pipelining needs the same layers at any batch size"
    )
