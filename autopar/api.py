"""`autopar.parallelize`: trace, search, lower and run, cached per argument signature."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

import cost_models
from autopar.cost.model import CostModel
from autopar.errors import AutoparError, MemoryBudgetError, MeshError, PlanError, format_bytes
from autopar.ir._compat import broadcast_prefix
from autopar.ir.capture import abstractify_tree, capture, fn_name
from autopar.ir.graph import Graph
from autopar.lower.jit import jit_from_plan
from autopar.meshes import MeshLike, make_mesh, pipeline_meshes, resolve
from autopar.passes.accumulate import accumulate
from autopar.passes.pipeline import (
    SCHEDULES,
    Pipeline,
    PipelinedScans,
    batch_size,
    check_pipeline,
    fuse,
    layer_ranges,
    micro_args,
    pipelined_scans,
    scan_labels,
    with_full_consts,
)
from autopar.passes.precision import compute_dtype_of, mixed_precision
from autopar.passes.precision import describe as describe_precision
from autopar.passes.remat import POLICIES as REMAT_POLICIES
from autopar.passes.remat import remat, remat_report
from autopar.plan.plan import BodyRecord, OpRecord, Plan, TensorRecord, fingerprint, op_keys
from autopar.search import search
from autopar.search.evaluate import output_specs
from autopar.search.problem import Problem, build_problem, find_aliases, step_floor
from autopar.sharding import MeshInfo, Spec, mesh_info

# Plans predicted to use more than this fraction of the budget are compiled once on
# the mesh (when it has devices) and judged by XLA's memory analysis, because the
# liveness estimate does not see XLA's own temporaries.
COMPILE_CHECK_FRACTION = 0.7
log = logging.getLogger("autopar")


@dataclass
class _Compiled:
    graph: Graph
    plan: Plan
    problem: Problem | None
    jitted: Any
    mesh: Mesh | AbstractMesh
    # some option (mesh shape, pipeline, engine) was turned away or reshaped by the
    # memory budget: more rematerialization might let a faster one fit
    memory_bound: bool = False


class Parallelized:
    """What `parallelize` returns: call it like the function, or `.plan()` / `.lower()`."""

    def __init__(
        self,
        fn,
        *,
        mesh,
        cluster,
        engine,
        memory_budget,
        static_argnums,
        donate_argnums,
        plan,
        in_specs=None,
        allow_partial=False,
        pipeline_stages=None,
        microbatches=None,
        pipeline_schedule=None,
        precision=None,
        grad_accumulation=None,
        remat=None,
    ):
        self.fn = fn
        # traced as trailing positional arguments, after the positional ones
        self.keywords = _keyword_only(fn)
        self.profile = cost_models.load(cluster)
        if pipeline_stages == "auto":
            self.meshes = _pipeline_meshes(mesh, self.profile.devices_per_node)
        else:
            self.meshes = resolve(mesh, self.profile.devices_per_node)
        self.engine = engine
        self.memory_budget = (
            float(memory_budget) if memory_budget is not None else self.profile.hbm_bytes
        )
        self.static_argnums = tuple(static_argnums)
        self.donate_argnums = tuple(donate_argnums)
        self.in_specs = in_specs
        self.allow_partial = allow_partial
        if pipeline_stages not in (None, "auto") and (
            not isinstance(pipeline_stages, int) or pipeline_stages < 1
        ):
            raise MeshError(
                f"pipeline_stages must be a positive int (the size of the mesh's 'stage' axis) "
                f"or 'auto', got {pipeline_stages!r}"
            )
        self.pipeline_stages = pipeline_stages
        self.microbatches = microbatches
        if pipeline_schedule not in (None, *SCHEDULES):
            raise MeshError(
                f"pipeline_schedule={pipeline_schedule!r}: choose None (1F1B where the step "
                f"allows it, else GPipe) or one of {SCHEDULES}"
            )
        self.pipeline_schedule = pipeline_schedule
        self.given_plan = Plan.load(plan) if isinstance(plan, str | os.PathLike) else plan
        if precision is None and self.given_plan is not None:
            precision = self.given_plan.precision
        self.precision = _precision(precision)
        if grad_accumulation is None and self.given_plan is not None:
            grad_accumulation = self.given_plan.grad_accumulation
        if grad_accumulation is not None and (
            not isinstance(grad_accumulation, int) or grad_accumulation < 1
        ):
            raise AutoparError(
                f"grad_accumulation must be a positive int (micro-batches per step), got "
                f"{grad_accumulation!r}"
            )
        if grad_accumulation and pipeline_stages:
            raise AutoparError(
                "grad_accumulation and pipeline_stages do not combine: a pipeline already "
                "runs its layers micro-batch by micro-batch (set microbatches= instead)"
            )
        self.grad_accumulation = grad_accumulation
        if remat is None and self.given_plan is not None:
            remat = self.given_plan.remat
        if remat not in (None, "auto", *REMAT_POLICIES):
            raise AutoparError(f"remat={remat!r}: choose None, 'auto' or one of {REMAT_POLICIES}")
        self.remat = remat
        self._cache: dict[Any, _Compiled] = {}
        functools.update_wrapper(self, fn)

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        """The mesh of the most recent plan (the only one unless mesh search is on)."""
        if self._cache:
            return next(reversed(self._cache.values())).mesh
        return self.meshes[0]

    # ---- public -------------------------------------------------------------------------
    def plan(self, *args, **kwargs) -> Plan:
        """Search (or load) the plan for these arguments. Abstract args are fine."""
        return self._get(self._positional(args, kwargs)).plan

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """Lower the sharded program, like `jax.jit(fn).lower(*args)`."""
        args = self._positional(args, kwargs)
        c = self._get(args)
        return _lower(c.jitted, self._flat_dyn(args), c.plan, c.mesh)

    def __call__(self, *args, **kwargs):
        args = self._positional(args, kwargs)
        if isinstance(self.meshes[0], AbstractMesh):
            m = self.meshes[0]
            raise MeshError(
                f"{fn_name(self.fn)}: the mesh {dict(zip(m.axis_names, m.axis_sizes))} needs "
                f"{math.prod(m.axis_sizes)} devices but only {len(jax.devices())} are available here. "
                "Use .plan() or .lower() to plan offline, or run on a machine with enough devices "
                "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)."
            )
        c = self._get(args)
        flat = self._flat_dyn(args)
        for x, r in zip(flat, c.plan.inputs):
            if isinstance(x, jax.Array) and x.is_deleted():
                raise AutoparError(
                    f"{fn_name(self.fn)}: argument {r.path} {r.dtype}{list(r.shape)} was deleted, most "
                    f"likely donated to an earlier call (donate_argnums={self.donate_argnums}); pass the "
                    "updated value that call returned instead"
                )
        placed = [
            jax.device_put(x, NamedSharding(c.mesh, r.spec.to_pspec()))
            if isinstance(x, jax.Array | np.ndarray)
            else x
            for x, r in zip(flat, c.plan.inputs)
        ]
        outs = c.jitted(*placed)
        return jax.tree_util.tree_unflatten(c.graph.out_tree, outs)

    # ---- internals ----------------------------------------------------------------------
    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """The arguments as autopar traces them: keyword arguments bound to their
        positions, then the keyword-only ones in `self.keywords` order (defaults
        filled in)."""
        if not kwargs and not self.keywords:
            return args
        sig = inspect.signature(self.fn)
        try:
            bound = sig.bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise AutoparError(f"{fn_name(self.fn)}: cannot bind the arguments: {e}") from None
        extra = sorted(set(bound.kwargs) - set(self.keywords))
        if extra:
            raise AutoparError(
                f"{fn_name(self.fn)}: keyword arguments {extra} would go to its **kwargs, which "
                "autopar does not trace; give them parameters of their own or close over them"
            )
        kw = [bound.arguments.get(k, sig.parameters[k].default) for k in self.keywords]
        return (*bound.args, *kw)

    def _in_specs(self, args: tuple) -> Any:
        """`in_specs`, with None (searched) for the keyword-only arguments when it
        names only the positional ones."""
        n_kw, specs = len(self.keywords), self.in_specs
        if n_kw and isinstance(specs, tuple | list) and len(specs) == len(self._dyn(args)) - n_kw:
            return (*specs, *[None] * n_kw)
        return specs

    def _n_positional(self, args: tuple) -> int:
        """How many of the traced `args` are positional (what argnums count)."""
        return len(args) - len(self.keywords)

    def _dyn(self, args) -> tuple:
        static = _norm(self.static_argnums, self._n_positional(args))
        return tuple(a for i, a in enumerate(args) if i not in static)

    def _flat_dyn(self, args) -> list:
        return jax.tree_util.tree_leaves(self._dyn(args))

    def _key(self, args):
        leaves, tree = jax.tree_util.tree_flatten(abstractify_tree(self._dyn(args)))
        sig = tuple(
            (tuple(x.shape), str(x.dtype))
            if isinstance(x, jax.ShapeDtypeStruct)
            else ("py", type(x).__name__)
            for x in leaves
        )
        statics = tuple(
            _hashable(args[i]) for i in _norm(self.static_argnums, self._n_positional(args))
        )
        return (tree, sig, statics)

    def _get(self, args) -> _Compiled:
        key = self._key(args)
        if key not in self._cache:
            self._cache[key] = self._compile(args)
        return self._cache[key]

    def _compile(self, args) -> _Compiled:
        if self.remat != "auto":
            return self._compile_with(args, self.remat)
        tried, best = [], None
        for policy in REMAT_POLICIES:  # most memory, least recompute first
            try:
                got = self._compile_with(args, policy)
            except MemoryBudgetError as e:
                tried.append(f"remat={policy}: {str(e).splitlines()[0]}")
                continue
            tried.append(f"remat={policy}: {got.plan.cost.step_s * 1e3:.4g} ms")
            if best is None or got.plan.cost.step_s < best.plan.cost.step_s:
                best = got
            if not got.memory_bound:  # nothing held back by memory: more remat only adds work
                break
        if best is not None:
            note = "remat='auto' tried " + "; ".join(tried)
            return replace(best, plan=replace(best.plan, warnings=(*best.plan.warnings, note)))
        raise MemoryBudgetError(
            f"{fn_name(self.fn)}: no rematerialization policy fits the budget:\n  "
            + "\n  ".join(tried)
        )

    def _prepare(self, graph: Graph, remat_policy: str | None) -> tuple[Graph, tuple[str, ...]]:
        """The passes every trace goes through before search: mixed precision, remat.
        Returns the graph and the notes for the plan."""
        notes: tuple[str, ...] = ()
        if self.precision is not None:
            notes += describe_precision(graph, self.precision).notes()
            graph = mixed_precision(graph, self.precision)
        if remat_policy not in (None, "none"):
            before, graph = graph, remat(graph, remat_policy)
            notes += remat_report(before, graph, remat_policy).notes()
        return graph, notes

    def _compile_with(self, args, remat_policy: str | None) -> _Compiled:
        single = len(self.meshes) == 1
        static = _norm(self.static_argnums, self._n_positional(args))
        log.info("tracing %s", fn_name(self.fn))
        graph = capture(self.fn, args, static, self.meshes[0] if single else None, self.keywords)
        graph, notes = self._prepare(graph, remat_policy)
        if self.grad_accumulation and self.grad_accumulation > 1:
            graph = self._accumulated(
                graph, args, static, self.meshes[0] if single else None, remat_policy
            )
        donate = _flat_donate(args, static, _norm(self.donate_argnums, self._n_positional(args)))
        reused: dict[int, Spec] = {}
        if self.given_plan is not None:
            mesh = self._mesh_for_plan(self.given_plan)
            try:
                plan = bind_plan(
                    self.given_plan, graph, mesh_info(mesh, self.profile.devices_per_node), mesh
                )
                pipelined = None
                if plan.pipeline:
                    pipe = Pipeline.from_json(plan.pipeline)
                    pipelined = self._pipelined(graph, args, static, pipe, mesh, remat_policy)
                jitted = jit_from_plan(graph, plan, mesh, donate, pipelined)
                return _Compiled(graph, plan, None, jitted, mesh)
            except PlanError:
                if not self.allow_partial:
                    raise
                reused = reusable_specs(
                    self.given_plan, graph, mesh_info(mesh, self.profile.devices_per_node)
                )
        options, failures, tries = [], [], []
        memory_bound = False
        for k, mesh in enumerate(self.meshes):
            try:
                pipes = self._pipelines(graph, args, static, mesh, remat_policy)
            except MeshError as e:
                if single:
                    raise
                failures.append(f"{dict(zip(mesh.axis_names, mesh.axis_sizes))}: {e}")
                continue
            tries += [(k, mesh, p) for p in pipes]
        # Cheapest floor first; on an abstract mesh (no compile check can turn plans
        # away afterwards) a try whose floor is above the best price found is skipped.
        floors = [step_floor(graph, mesh.size, self.profile, p) for _, mesh, p in tries]
        best, skipped = math.inf, 0
        for i in sorted(range(len(tries)), key=lambda i: (floors[i], i)):
            k, mesh, pipelined = tries[i]
            if isinstance(mesh, AbstractMesh) and floors[i] >= best:
                skipped += 1
                continue
            info = mesh_info(mesh, self.profile.devices_per_node)
            log.info("mesh %s: pricing the strategies of %d ops", info.shape, len(graph.nodes))
            problem = build_problem(graph, info, CostModel(self.profile, info), pipelined)
            try:
                pins = (
                    user_pins(problem, self._dyn(args), self._in_specs(args))
                    if self.in_specs is not None
                    else {}
                )
                pins.update(_spec_pins(problem, reused))
                result = search(problem, self.engine, self.memory_budget, pins)
            except (MemoryBudgetError, MeshError) as e:
                if len(tries) == 1:
                    raise
                failures.append(f"{info.shape}: {str(e).splitlines()[0]}")
                memory_bound |= isinstance(e, MemoryBudgetError)
                continue
            options += [
                (cost.step_s, k, name, mesh, problem, result, pipelined)
                for name, _, cost in result.ranked
            ]
            best = min([best] + [cost.step_s for _, _, cost in result.ranked])
        if not options:
            raise MemoryBudgetError(
                "no mesh shape gives a plan that fits:\n  " + "\n  ".join(failures)
            )
        options.sort(key=lambda o: o[:3])
        if self.pipeline_stages == "auto":
            notes += (_pipeline_tries(options, failures),)
        if skipped:
            notes += (
                f"{skipped} of {len(tries)} (mesh, micro-batch count) tries not searched: "
                "all their FLOPs at the profile's peak rate already take longer than the "
                "best plan found (`search.problem.step_floor`)",
            )
        rejected = []
        for _, _, name, mesh, problem, result, pipelined in options:
            plan = make_plan(problem, result.pick(name), self.profile, mesh, pipelined)
            plan = replace(
                plan,
                precision=self.precision,
                grad_accumulation=self.grad_accumulation,
                remat=remat_policy if remat_policy != "none" else None,
                warnings=(*notes, *plan.warnings),
            )
            jitted = jit_from_plan(graph, plan, mesh, donate, pipelined)
            if (
                isinstance(mesh, Mesh)
                and plan.cost.peak_memory_bytes > COMPILE_CHECK_FRACTION * self.memory_budget
            ):
                log.info("compiling %s to check its memory", info_str(plan))
                compiled = compiled_memory(
                    _lower(jitted, self._flat_dyn(args), plan, mesh).compile()
                )
                plan = replace(plan, compiled_memory_bytes=compiled)
                if compiled > self.memory_budget:
                    rejected.append(f"{info_str(plan)}: compiled {format_bytes(compiled)}")
                    continue
            if rejected:
                plan = replace(
                    plan,
                    warnings=plan.warnings
                    + tuple(f"rejected after compiling: {r}" for r in rejected),
                )
            if self.given_plan is not None:
                note = (
                    f"partial reuse of a plan for {self.given_plan.function or '?'}: kept the specs "
                    f"of {len(reused)} of {len(graph.inputs)} arguments whose path, shape and dtype "
                    "match; searched everything else afresh"
                )
                plan = replace(plan, warnings=(note, *plan.warnings))
            memory_bound |= bool(rejected) or "+zero" in plan.engine
            return _Compiled(graph, plan, problem, jitted, mesh, memory_bound)
        raise MemoryBudgetError(
            f"every plan the cost model fit into {format_bytes(self.memory_budget)} needs more once compiled by XLA:\n  "
            + "\n  ".join(rejected)
            + "\nRaise memory_budget, use more devices, or shrink the batch."
        )

    def _accumulated(self, graph: Graph, args, static, mesh, remat_policy) -> Graph:
        """`graph` with its per-micro-batch part in a loop (`autopar.passes.accumulate`); the
        batch is the last non-static argument, cut along its leaves' leading dim."""
        M, name = self.grad_accumulation, fn_name(self.fn)
        dyn = [i for i in range(self._n_positional(args)) if i not in static]
        if not dyn:
            raise AutoparError(f"{name}: grad_accumulation needs a batch argument")
        leaves = [jax.tree_util.tree_leaves(args[i]) for i in dyn]
        first = sum(len(x) for x in leaves[:-1])
        batch = leaves[-1]
        sizes = {getattr(x, "shape", (None,))[:1] for x in batch}
        if len(sizes) != 1 or not next(iter(sizes)) or next(iter(sizes))[0] % M:
            shapes = ", ".join(str(tuple(getattr(x, "shape", ()))) for x in batch)
            raise AutoparError(
                f"{name}: grad_accumulation={M} cuts the last argument (the batch) along its "
                f"leading dim, but its leaves have shapes {shapes}; they need one leading size "
                f"divisible by {M}"
            )
        (b,) = next(iter(sizes))
        margs = list(args)
        cut = lambda x: jax.ShapeDtypeStruct((b // M, *x.shape[1:]), x.dtype)
        margs[dyn[-1]] = jax.tree_util.tree_map(cut, abstractify_tree(args[dyn[-1]]))
        log.info("tracing %s at the micro-batch size", name)
        micro = capture(self.fn, tuple(margs), static, mesh, self.keywords)
        micro, _ = self._prepare(micro, remat_policy)
        return accumulate(graph, micro, range(first, first + len(batch)), M, mesh)

    def _pipelines(
        self, graph: Graph, args, static, mesh, remat_policy
    ) -> list[PipelinedScans | None]:
        """The pipelines to try on `mesh`: none, or `pipeline_stages` with each candidate
        micro-batch count (`microbatches`, else S, 2S and 4S where they cut the batch)."""
        if self.pipeline_stages is None:
            return [None]
        S = self.pipeline_stages
        if S == "auto":  # one candidate mesh of `pipeline_meshes`: its stage axis
            if "stage" not in mesh.axis_names:
                return [None]
            S = dict(zip(mesh.axis_names, mesh.axis_sizes))["stage"]
            if not pipelined_scans(graph, Pipeline(S, 1)):
                return []
        check_pipeline(Pipeline(S, 1), mesh_info(mesh, self.profile.devices_per_node))
        scans = pipelined_scans(graph, Pipeline(S, 1))
        if not scans:
            loops = [n.params["length"] for n in graph.nodes if n.body is not None]
            raise MeshError(
                f"{fn_name(self.fn)}: pipeline_stages={S} pipelines a loop over layers, but "
                + (
                    f"no scan's length ({loops}) is a multiple of {S}"
                    if loops
                    else "the function has none; put the layers under a scan (flax.linen.scan, "
                    "jax.lax.scan; e.g. GPTConfig(scan_layers=True))"
                )
            )
        batch = batch_size(graph, scans)
        counts = (
            [self.microbatches]
            if self.microbatches is not None
            else [m for m in (S, 2 * S, 4 * S, 8 * S, 12 * S) if batch % m == 0] or [1]
        )
        out, skipped = [], []
        schedule = self.pipeline_schedule or "1f1b"
        for m in counts:
            try:
                pipe = Pipeline(S, m, schedule)
                out.append(self._pipelined(graph, args, static, pipe, mesh, remat_policy))
            except MeshError as e:  # e.g. a batch of 1 traces to different ops
                if self.microbatches is not None:
                    raise
                skipped.append(f"{m} micro-batches: {e}")
        if not out:
            raise MeshError("no micro-batch count works:\n  " + "\n  ".join(skipped))
        return out

    def _pipelined(
        self, graph: Graph, args, static, pipe: Pipeline, mesh, remat_policy
    ) -> PipelinedScans:
        """Capture the function again at the micro-batch size and pair its scans with
        `graph`'s pipelined ones."""
        check_pipeline(pipe, mesh_info(mesh, self.profile.devices_per_node))
        scans = pipelined_scans(graph, pipe)
        name = fn_name(self.fn)
        dyn, tree = jax.tree_util.tree_flatten(self._dyn(args))
        micro_dyn = iter(
            jax.tree_util.tree_unflatten(
                tree,
                micro_args(
                    dyn,
                    batch_size(graph, scans),
                    pipe.microbatches,
                    name,
                    keep=set(find_aliases(graph).values()),
                ),
            )
        )
        margs = tuple(a if i in static else next(micro_dyn) for i, a in enumerate(args))
        log.info("tracing %s at the micro-batch size", name)
        micro = capture(self.fn, margs, static, mesh, self.keywords)
        micro, _ = self._prepare(micro, remat_policy)
        mscans = pipelined_scans(micro, pipe)
        if len(mscans) != len(scans):
            raise MeshError(
                f"{name}: at the micro-batch size the function has {len(mscans)} pipelinable "
                f"loops instead of {len(scans)}; pipelining needs the same loops at any batch size"
            )
        bodies = {
            i: (
                with_full_consts(micro.nodes[j].body, graph.nodes[i].body),
                scan_labels(graph.nodes[i], micro.nodes[j], pipe.microbatches, graph.nodes[i].key),
            )
            for i, j in zip(scans, mscans)
        }
        if pipe.schedule != "1f1b":
            return PipelinedScans(pipe, bodies)
        try:
            if scans != mscans:
                raise MeshError(f"{name}: the captures at the two batch sizes do not line up")
            fused = fuse(graph, micro, bodies, pipe.microbatches)
            if not fused:
                raise MeshError(f"{name}: no forward loop is followed by its backward loop")
        except MeshError as e:
            if self.pipeline_schedule == "1f1b":
                raise MeshError(f"pipeline_schedule='1f1b': {e}") from None
            log.info("1F1B does not apply (%s); GPipe", e)
            return PipelinedScans(replace(pipe, schedule="gpipe"), bodies)
        return PipelinedScans(pipe, bodies, fused)

    def _mesh_for_plan(self, plan: Plan) -> Mesh | AbstractMesh:
        for mesh in self.meshes:
            if (tuple(mesh.axis_names), tuple(mesh.axis_sizes)) == (
                plan.mesh.axis_names,
                plan.mesh.axis_sizes,
            ):
                return mesh
        return self.meshes[0]  # bind_plan reports the mismatch


def _pipeline_tries(options, failures) -> str:
    """The plan note of `pipeline_stages="auto"`: the best plan of every (mesh,
    micro-batch count) tried, and the meshes that had none."""
    best: dict[str, float] = {}
    for step_s, _, _, mesh, _, _, pipelined in options:
        shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
        key = f"{shape}" + (f" M={pipelined.pipe.microbatches}" if pipelined else "")
        best.setdefault(key, step_s)
    tried = [f"{k} {v * 1e3:.4g} ms" for k, v in best.items()]
    return "pipeline_stages='auto' tried (fastest first): " + "; ".join(
        tried + list(dict.fromkeys(f.splitlines()[0] for f in failures))
    )


def _pipeline_meshes(mesh, devices_per_node: int) -> list:
    """The meshes `pipeline_stages="auto"` tries (a device count, or "auto": all)."""
    if mesh == "auto":
        mesh = len(jax.devices())
    if not isinstance(mesh, int) or isinstance(mesh, bool):
        raise MeshError(
            f"pipeline_stages='auto' searches the mesh shape: pass mesh as a device count "
            f"(or 'auto'), not {mesh!r}; with a fixed mesh, pass pipeline_stages=<its 'stage' size>"
        )
    return [make_mesh(m) for m in pipeline_meshes(mesh, devices_per_node)]


def _precision(name: str | None) -> str | None:
    """The compute dtype's name for `precision=`: None (as traced), "bfloat16" or
    "float16"."""
    if name is None:
        return None
    aliases = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
    if name not in aliases:
        raise AutoparError(f"precision={name!r}: choose None (as traced), 'bf16' or 'fp16'")
    return compute_dtype_of(aliases[name]).name


def compiled_memory(compiled) -> int:
    """Per-device bytes XLA needs: arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def info_str(plan: Plan) -> str:
    return f"{plan.engine} on {plan.mesh.shape}"


def _lower(jitted, flat_args, plan: Plan, mesh) -> jax.stages.Lowered:
    flat = [_sds_for(x, r, mesh) for x, r in zip(flat_args, plan.inputs)]
    if isinstance(mesh, AbstractMesh):
        return jitted.trace(*flat).lower(lowering_platforms=("cuda",))
    return jitted.lower(*flat)


def parallelize(
    fn: Callable | None = None,
    *,
    mesh: MeshLike,
    cluster: str | os.PathLike | cost_models.ClusterProfile = "h100-sxm",
    engine: str = "auto",
    memory_budget: float | None = None,
    static_argnums: Sequence[int] | int = (),
    donate_argnums: Sequence[int] | int = (),
    plan: str | os.PathLike | Plan | None = None,
    in_specs: Any = None,
    allow_partial: bool = False,
    pipeline_stages: int | str | None = None,
    microbatches: int | None = None,
    pipeline_schedule: str | None = None,
    precision: str | None = None,
    grad_accumulation: int | None = None,
    remat: str | None = None,
) -> Parallelized | Callable[[Callable], Parallelized]:
    """Automatically shard `fn` over `mesh`.

    Traces `fn` on its first call (or on `.plan(*args)` / `.lower(*args)`, which accept
    `jax.ShapeDtypeStruct`s), searches a sharding for every op with the cost model of
    `cluster` under `memory_budget` bytes per device (default: the profile's HBM),
    and runs it as `jax.jit` with the plan's shardings. `engine` is one of "auto",
    "recursive", "dp", "ilp", "data", "fsdp". `plan` reuses a saved plan instead of
    searching; with `allow_partial=True`, a plan made for a different version of the
    function keeps the specs of the arguments that still match (path, shape, dtype)
    and searches the rest, saying so in the plan's warnings. `in_specs` fixes the specs of some arguments (semi-auto parallel): a
    pytree prefix of the non-static args with a PartitionSpec to fix a leaf (or a
    whole subtree) and None to let the search decide; every engine honours it, as it
    honours the function's own `with_sharding_constraint` calls (keyword-only
    arguments come after the positional ones there, as they are traced). Usable as
    `@parallelize(mesh=...)`.

    `pipeline_stages=S` runs every loop over layers (a `scan` whose length S divides,
    e.g. `flax.linen.scan`) as a pipeline over the mesh's `"stage"` axis (of size S)
    with `microbatches` micro-batches per step (default: the best of S, 2S, 4S, 8S and
    12S under the cost model); each stage's layers are searched on the other axes.
    `pipeline_schedule` is "1f1b" (the forward and backward layer loops interleaved in
    one pipeline, each stage holding at most 2S - 1 micro-batches' activations),
    "gpipe" (every forward pass, then every backward one: M micro-batches' activations)
    or None: 1F1B where the step splits that way, else GPipe. `pipeline_stages="auto"`
    with `mesh` a device count tries every stage count S dividing it, on
    `{"stage": S, "data": ..., "model": ...}` with the model axis
    inside a node (`meshes.pipeline_meshes`; S = 1 is no pipeline), and keeps the
    fastest plan that fits.

    `precision="bf16"` computes every float32 matmul and convolution on bfloat16
    operands with float32 accumulation, keeping float32 master weights, optimizer
    state and activations (`autopar.passes.precision`). `precision="fp16"` does the same in
    float16, each operand scaled by a power of two into float16's range from its own
    max|x| (per-tensor dynamic scaling, in place of loss scaling: the captured step is
    already differentiated).

    `grad_accumulation=M` cuts the batch (the last non-static argument, along its
    leaves' leading dim) into M micro-batches and runs everything that can go micro-batch
    by micro-batch (forward, backward, up to the gradient sums) in a loop over them,
    then the rest (the optimizer) once (`autopar.passes.accumulate`).

    `remat` rematerializes a layer loop's residuals (`autopar.passes.remat`, layers under a
    `scan`): "dots" keeps only matmul outputs and the layer input, "selective" also
    recomputes the matmul outputs cheapest to recompute per byte (a transformer's
    attention scores), "full" keeps only the layer input, and the backward loop
    recomputes the rest. "auto" tries "none", "dots", "selective", "full" in turn and
    keeps the fastest plan that fits `memory_budget`; it stops early once the budget
    constrained nothing (no mesh shape or pipeline turned away, no ZeRO retry), since
    then more recomputation can only add work.
    """
    as_tuple = lambda x: (x,) if isinstance(x, int) else tuple(x)
    kw = dict(
        mesh=mesh,
        cluster=cluster,
        engine=engine,
        memory_budget=memory_budget,
        static_argnums=as_tuple(static_argnums),
        donate_argnums=as_tuple(donate_argnums),
        plan=plan,
        in_specs=in_specs,
        allow_partial=allow_partial,
        pipeline_stages=pipeline_stages,
        microbatches=microbatches,
        pipeline_schedule=pipeline_schedule,
        precision=precision,
        grad_accumulation=grad_accumulation,
        remat=remat,
    )
    if fn is None:
        return lambda f: Parallelized(f, **kw)
    return Parallelized(fn, **kw)


def user_pins(problem: Problem, dyn_args: tuple, in_specs: Any) -> dict[int, int]:
    """Cost-graph pins for the argument specs the user fixed (`in_specs=`)."""
    from jax.sharding import PartitionSpec

    is_leaf = lambda x: x is None or isinstance(x, PartitionSpec)
    try:
        flat = broadcast_prefix(in_specs, dyn_args, is_leaf=is_leaf)
    except ValueError as e:
        raise MeshError(f"in_specs does not match the structure of the arguments: {e}") from None
    g, mesh = problem.graph, problem.mesh
    pins: dict[int, int] = {}
    for i, pspec in enumerate(flat):
        if pspec is None:
            continue
        t = g.values[g.inputs[i]]
        unknown = [
            a
            for d in pspec
            if d
            for a in ((d,) if isinstance(d, str) else d)
            if a not in mesh.axis_names
        ]
        if unknown or len(pspec) > t.rank:
            raise MeshError(
                f"in_specs for {g.input_paths[i]} {t}: {pspec} "
                + (
                    f"names axes {unknown} that the mesh {mesh.shape} does not have"
                    if unknown
                    else f"has more entries than the array has dims ({t.rank})"
                )
            )
        spec = Spec.from_pspec(pspec, t.rank)
        match = [k for k, s in enumerate(problem.strategies[i]) if s.out_specs[0] == spec]
        if not match:
            raise MeshError(
                f"in_specs for {g.input_paths[i]}: {pspec} cannot shard shape {list(t.shape)} on mesh {mesh.shape} "
                "(each sharded dim must be divisible by the product of its axes' sizes). Pick axes that divide it, or None to let autopar decide."
            )
        pins[i] = match[0]
    return pins


def reusable_specs(plan: Plan, graph: Graph, mesh: MeshInfo) -> dict[int, Spec]:
    """Input position -> the saved spec, for inputs of `graph` that `plan` also has with
    the same path, shape and dtype, and whose spec the mesh can still apply."""
    saved = {r.path: r for r in plan.inputs}
    out: dict[int, Spec] = {}
    for i, (path, v) in enumerate(zip(graph.input_paths, graph.inputs)):
        r, t = saved.get(path), graph.values[v]
        if r is None or (tuple(r.shape), r.dtype) != (t.shape, t.dtype.name):
            continue
        if all(a in mesh.axis_names for a in r.spec.used_axes):
            out[i] = r.spec
    return out


def _spec_pins(problem: Problem, specs: dict[int, Spec]) -> dict[int, int]:
    pins = {}
    for i, spec in specs.items():
        match = [k for k, s in enumerate(problem.strategies[i]) if s.out_specs[0] == spec]
        if match:
            pins[i] = match[0]
    return pins


def make_plan(
    problem: Problem, result, profile, jax_mesh, pipelined: PipelinedScans | None = None
) -> Plan:
    g = problem.graph
    inputs, outputs, ops = _records(problem, result.choice)
    pipeline = None
    if pipelined is not None:
        keys = op_keys(g)
        pipeline = {
            **pipelined.pipe.to_json(),
            "scans": [
                {
                    "op": keys[i],
                    "stages": [list(r) for r in layer_ranges(g.nodes[i], pipelined.pipe)],
                }
                for i in pipelined.scans
            ],
        }
        if pipelined.fused:
            pipeline["fused"] = [
                {
                    "forward": keys[f.forward],
                    "backward": keys[f.backward],
                    "head": [keys[h] for h in f.head],
                }
                for f in pipelined.fused
            ]
    return Plan(
        fingerprint=fingerprint(g),
        mesh=problem.mesh,
        cluster=profile.to_dict(),
        engine=result.engine,
        search_seconds=result.seconds,
        inputs=inputs,
        outputs=outputs,
        ops=ops,
        cost=result.cost,
        warnings=problem.warnings,
        candidates=result.candidates,
        search_info=result.solver_info,
        function=g.name,
        in_tree=g.in_tree,
        out_tree=g.out_tree,
        jax_mesh=jax_mesh,
        pipeline=pipeline,
    )


def _records(problem: Problem, choice) -> tuple[tuple, tuple, tuple]:
    """(inputs, outputs, ops) records of a choice; a scan op carries its body's, a
    cond its branches'."""
    g, n_in = problem.graph, problem.num_inputs
    strat = lambda v: problem.strategies[v][choice[v]]
    inputs = tuple(
        TensorRecord(p, g.values[v].shape, g.values[v].dtype.name, strat(i).out_specs[0])
        for i, (p, v) in enumerate(zip(g.input_paths, g.inputs))
    )
    outputs = tuple(
        TensorRecord(p, g.values[v].shape, g.values[v].dtype.name, spec)
        for p, v, spec in zip(g.output_paths, g.outputs, output_specs(problem, choice))
    )

    def body(n):
        if n.id not in problem.bodies:
            return None
        sub, results = problem.bodies[n.id]
        res = results[choice[n_in + n.id]]
        return BodyRecord(res.engine, *_records(sub, res.choice), res.cost)

    def branches(n):
        if n.id not in problem.conds:
            return None
        subs, per_strategy = problem.conds[n.id]
        outs = strat(n_in + n.id).out_specs
        recs = []
        for sub, res in zip(subs, per_strategy[choice[n_in + n.id]].results):
            ins, have, ops = _records(sub, res.choice)
            want = tuple(replace(r, spec=sp) for r, sp in zip(have, outs))
            recs.append(BodyRecord(res.engine, ins, want, ops, res.cost))
        return tuple(recs)

    keys = op_keys(g)
    ops = tuple(
        OpRecord(
            keys[n.id],
            n.op,
            n.source,
            strat(n_in + n.id).name,
            strat(n_in + n.id).in_specs,
            strat(n_in + n.id).out_specs,
            float(problem.node_time[n_in + n.id][choice[n_in + n.id]]),
            body(n),
            branches(n),
        )
        for n in g.nodes
    )
    return inputs, outputs, ops


def bind_plan(plan: Plan, graph: Graph, mesh: MeshInfo, jax_mesh) -> Plan:
    """Check a loaded plan against the traced function and attach the pytrees."""
    problems = []
    if (plan.mesh.axis_names, plan.mesh.axis_sizes) != (mesh.axis_names, mesh.axis_sizes):
        problems.append(
            f"the plan is for mesh {plan.mesh.shape}, the function runs on {mesh.shape}"
        )
    if plan.fingerprint != fingerprint(graph):
        have = {r.path: (r.shape, r.dtype) for r in plan.inputs}
        want = {
            p: (graph.values[v].shape, graph.values[v].dtype.name)
            for p, v in zip(graph.input_paths, graph.inputs)
        }
        diffs = [
            f"{p}: plan {have.get(p)} vs function {want.get(p)}"
            for p in dict.fromkeys([*have, *want])
            if have.get(p) != want.get(p)
        ]
        detail = (
            "; ".join(diffs[:5])
            if diffs
            else f"same arguments but a different computation ({len(plan.ops)} ops in the plan, {len(graph.nodes)} traced)"
        )
        problems.append(f"the plan was made for a different function: {detail}")
    if problems:
        raise PlanError(
            f"plan for {plan.function or '?'} does not match {graph.name}: "
            + "; ".join(problems)
            + ". Search a new plan (omit plan=) for this function."
        )
    return Plan(
        **{
            **plan.__dict__,
            "in_tree": graph.in_tree,
            "out_tree": graph.out_tree,
            "jax_mesh": jax_mesh,
        }
    )


def _sds_for(x, rec: TensorRecord, mesh):
    a = abstractify_tree(x)
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, rec.spec.to_pspec())
        )
    return a


def _keyword_only(fn: Callable) -> tuple[str, ...]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)


def _norm(argnums: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Argument positions as jax.jit reads them: negative ones count from the end."""
    return tuple(i % n for i in argnums if -n <= i < n)


def _flat_donate(args, static_argnums, donate_argnums) -> tuple[int, ...]:
    out, pos = [], 0
    for i, a in enumerate(args):
        if i in static_argnums:
            continue
        n = len(jax.tree_util.tree_leaves(a))
        if i in donate_argnums:
            out.extend(range(pos, pos + n))
        pos += n
    return tuple(out)


def _hashable(x):
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)
