"""`autopar.parallelize`: what the user holds. `Parallelized` validates the options once,
binds each call's arguments, and keeps one compiled program per argument signature;
`autopar.compile` traces, searches, makes the plan and lowers it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

import cost_models
from autopar.compile import (
    Call,
    Compiled,
    Options,
    bind_plan,
    compile_step,
    compiled_memory,
    lowered,
    make_plan,
)
from autopar.compile.cache import cache_dir as _cache_dir
from autopar.compile.cache import source_key
from autopar.compile.notes import weak_types_changed
from autopar.compile.progress import Progress
from autopar.compile.progress import enabled as _progress_enabled
from autopar.compile.step import plan_by_source
from autopar.errors import (
    AutoparError,
    MeshError,
    MicrobatchError,
    PipelineError,
    did_you_mean,
    user_level,
)
from autopar.frontends import Bound, bind, check_static_argnames, is_graph_node, unwrap
from autopar.ir.capture import abstractify_tree, fn_name, leaf_signature
from autopar.lower.rolled import RolledIO, abstract_inputs
from autopar.meshes import MeshLike, make_mesh, pipeline_meshes, resolve, staged_meshes
from autopar.passes.pipeline import SCHEDULES
from autopar.passes.precision import compute_dtype_of
from autopar.passes.remat import POLICIES as REMAT_POLICIES
from autopar.plan.plan import Plan
from autopar.search import ENGINES

# bind_plan, compiled_memory and make_plan are re-exported (the CLI, tests, benchmarks)
__all__ = ["Parallelized", "bind_plan", "compiled_memory", "make_plan", "parallelize"]


_UNSET: Any = object()  # `Parallelized._get`: the trace-free key not computed yet


class Parallelized:
    """What `parallelize` returns: call it like the function, or `.plan()` / `.lower()`."""

    def __init__(self, fn, static_argnames: Sequence[str] | str = (), **options):
        self.fn = fn
        # jax.jit / nnx.jit / eqx.filter_jit wrappers are unwrapped: autopar is the jit
        target = unwrap(fn)
        self._filtered = target.filtered
        if target.static_argnums:
            options["static_argnums"] = (*options.get("static_argnums", ()), *target.static_argnums)
        if target.donate_argnums:  # jax.jit's donation stands: autopar is the jit now
            given = (*options.get("donate_argnums", ()), *target.donate_argnums)
            options["donate_argnums"] = tuple(dict.fromkeys(given))
        if target.dropped:
            warnings.warn(
                f"autopar: {fn_name(target.fn)}: {target.dropped} are not carried over (autopar "
                "replaces the jit); pass donate_argnums= to autopar.parallelize instead",
                stacklevel=user_level(),
            )
        self.options = _options(target.fn, **options)
        names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self.static_argnames = check_static_argnames(target.fn, (*names, *target.static_argnames))
        self._cache: dict[Any, Compiled] = {}
        self._programs: dict[Any, Any] = {}  # frontends.Program per cache key
        # the name, docstring and __wrapped__ only: a wrapper's __dict__ (nnx.jit's
        # `static_argnums=None`, say) must not overwrite autopar's own attributes
        functools.update_wrapper(self, fn, updated=())

    def __getattr__(self, name: str):
        """The validated options read as attributes (`step.memory_budget`, `step.meshes`)."""
        options = self.__dict__.get("options")
        if options is not None and name in Options.__dataclass_fields__:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        """The mesh of the most recent plan (the only one unless mesh search is on)."""
        if self._cache:
            return next(reversed(self._cache.values())).mesh
        return self.options.meshes[0]

    # ---- public -------------------------------------------------------------------------
    def plan(self, *args, **kwargs) -> Plan:
        """Search (or load) the plan for these arguments. Abstract args are fine. With
        the plan cache on, an unchanged program's plan is read without tracing it
        (`compile.fingerprint`); calling the function still traces and checks it."""
        call, bound = self._bind(args, kwargs)
        if (bound.key, *self._key(call)) in self._cache:
            return self._get(call, bound).plan
        options = self._traced_options(bound)
        source = self._source_key(options, call, bound)
        found = plan_by_source(options, call, source)
        return found if found is not None else self._get(call, bound, source).plan

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """Lower the sharded program, like `jax.jit(fn).lower(*args)`."""
        call, bound = self._bind(args, kwargs)
        c = self._get(call, bound)
        flat = abstract_inputs(c.roll, call.flat) if c.roll else call.flat
        return lowered(c.jitted, flat, c.plan, c.mesh)

    def unstaged(self, tree: Any) -> Any:
        """`tree` with every array a pipeline left on its stage's devices (a leaf of a
        layer unrolled in Python, on the stage's sub-mesh) copied onto the whole mesh,
        its spec kept (replicated over the stage axis), for functions other than this
        one (an `nnx.jit` or eager evaluation of the trained model, which raises JAX's
        "incompatible devices" on such leaves). NNX modules and optimizers in `tree` are
        updated in place and returned; other leaves come back as they are."""
        full = self.mesh
        if isinstance(full, AbstractMesh):
            raise MeshError(f"{fn_name(self.fn)}: unstaged() needs a mesh of real devices")

        def place(x):
            sharding = getattr(x, "sharding", None)
            if not isinstance(sharding, NamedSharding) or sharding.mesh.size == full.size:
                return x
            return jax.device_put(x, NamedSharding(full, sharding.spec))

        def one(node):
            if is_graph_node(node):
                from flax import nnx

                nnx.update(node, jax.tree_util.tree_map(place, nnx.state(node)))
                return node
            return place(node)

        return jax.tree_util.tree_map(one, tree, is_leaf=is_graph_node)

    def __call__(self, *args, **kwargs):
        call, bound, o = *self._bind(args, kwargs), self.options
        if isinstance(o.meshes[0], AbstractMesh):
            m = o.meshes[0]
            raise MeshError(
                f"{fn_name(self.fn)}: the mesh {dict(zip(m.axis_names, m.axis_sizes))} needs "
                f"{math.prod(m.axis_sizes)} devices but only {len(jax.devices())} are available here. "
                "Use .plan() or .lower() to plan offline, or run on a machine with enough devices "
                "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)."
            )
        c = self._get(call, bound)
        flat = call.flat
        paths = [r.path for r in c.plan.inputs]
        if c.roll is not None:  # the plan's inputs are the rolled ones: a leaf's group
            paths = [""] * len(flat)
            for r, ms in zip(c.plan.inputs, c.roll.inputs):
                for m in ms:
                    paths[m] = r.path
        for x, p in zip(flat, paths):
            if isinstance(x, jax.Array) and x.is_deleted():
                raise AutoparError(
                    f"{fn_name(self.fn)}: argument {p} {x.dtype}{list(x.shape)} was deleted, most "
                    f"likely donated to an earlier call (donate_argnums={self.options.donate_argnums}); "
                    "pass the updated value that call returned instead"
                )
        program = self._programs[(bound.key, *self._key(call))]
        # a Python scalar (flax TrainState's `step=0`) goes in as the array the step
        # returns for it, weakly typed and on the mesh: passed as it is, the next call's
        # array would miss jit's cache (a second trace and compile of the same program)
        put = lambda x: jax.device_put(x, NamedSharding(c.mesh, PartitionSpec()))  # noqa: E731
        flat = [put(x) if isinstance(x, int | float | complex) else x for x in flat]
        if c.roll is not None:  # unrolled layers rolled into a pipeline: leaves to groups
            if c.io is None:
                specs = [r.spec.to_pspec() for r in c.plan.inputs]
                c.io = RolledIO(c.roll, c.mesh, specs, c.plan.pipeline["axis"])
            outs = c.io.outputs(c.run(c.io.inputs(flat), o.memory_budget, fn_name(self.fn)))
            return program.finish(jax.tree_util.tree_unflatten(c.roll.out_tree, outs), bound.nodes)
        placed = [
            jax.device_put(x, NamedSharding(c.mesh, r.spec.to_pspec()))
            if isinstance(x, jax.Array | np.ndarray)
            else x
            for x, r in zip(flat, c.plan.inputs)
        ]
        outs = c.run(placed, o.memory_budget, fn_name(self.fn))
        return program.finish(jax.tree_util.tree_unflatten(c.graph.out_tree, outs), bound.nodes)

    # ---- internals ----------------------------------------------------------------------
    def _bind(self, args: tuple, kwargs: dict) -> tuple[Call, Bound]:
        """The arguments as autopar traces them (`frontends.bind`): the positional ones,
        then those passed by keyword; defaults the caller did not pass are not traced;
        NNX graph nodes split into their state, Equinox modules into their arrays;
        argnums normalized, donated leaves flattened, `in_specs` covering every
        non-static argument."""
        o = self.options
        b = bind(
            o.fn,
            args,
            kwargs,
            static_argnums=o.static_argnums,
            static_argnames=self.static_argnames,
            donate_argnums=o.donate_argnums,
            in_specs=o.in_specs,
            filtered=self._filtered,
        )
        return Call(b.args, b.static, b.donate, b.in_specs), b

    def _key(self, call: Call):
        leaves, tree = jax.tree_util.tree_flatten(abstractify_tree(call.dyn))
        sig = tuple(leaf_signature(x) for x in leaves)
        statics = tuple(_hashable(call.args[i]) for i in call.static)
        return (tree, sig, statics)

    def _traced_options(self, bound: Bound) -> Options:
        # the driver traces the frontend's pure program, under the slots' names
        return dataclasses.replace(self.options, fn=bound.program, keywords=bound.program.keywords)

    def _source_key(self, options: Options, call: Call, bound: Bound) -> str | None:
        if options.cache_dir is None or options.given_plan is not None:
            return None
        return source_key(options, call, self.options.fn, bound.key)

    def _get(self, call: Call, bound: Bound, source: str | None = _UNSET) -> Compiled:
        """The compiled program of this call; `source` is its trace-free cache key when
        the caller already has it (`plan`)."""
        key = (bound.key, *self._key(call))
        if key not in self._cache:
            if why := weak_types_changed(self._cache, key, call.dyn):
                warnings.warn(
                    f"autopar: {fn_name(self.options.fn)}: {why}", stacklevel=user_level()
                )
            self._programs[key] = bound.program
            options = self._traced_options(bound)
            if source is _UNSET:
                source = self._source_key(options, call, bound)
            with Progress() if self.options.progress else contextlib.nullcontext():
                self._cache[key] = compile_step(options, call, source, [*self._cache.values()])
        return self._cache[key]


def _warn_idle(fn, meshes: Sequence) -> None:
    """A warning where the mesh takes fewer devices than this process has (as
    `jax.make_mesh`, it takes the first ones without a word): the rest stay idle."""
    have = len(jax.devices())
    sizes = [m.size for m in meshes if isinstance(m, Mesh)]
    if sizes and max(sizes) < have:
        k = max(sizes)
        warnings.warn(
            f"autopar: {fn_name(fn)}: the mesh takes {k} of the {have} devices here (the first "
            f"{k}), leaving {have - k} idle. Give a mesh whose axis sizes multiply to {have} "
            f"(or mesh={have} to search its shape) to use them all",
            stacklevel=user_level(),
        )


def _options(
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
    virtual_stages=None,
    precision=None,
    grad_accumulation=None,
    remat=None,
    time_limit=None,
    progress=None,
    cache_dir=None,
) -> Options:
    """`parallelize`'s options, checked and resolved (meshes, profile, a plan file,
    defaults from a given plan), in one place."""
    try:
        profile = cost_models.load(cluster)
    except (ValueError, TypeError, OSError) as e:  # cost_models knows nothing of autopar
        raise AutoparError(str(e)) from None  # it names the profile asked for
    if pipeline_stages not in (None, "auto") and (
        not isinstance(pipeline_stages, int)
        or isinstance(pipeline_stages, bool)
        or pipeline_stages < 1
    ):
        raise PipelineError(
            f"pipeline_stages must be a positive int (the size of the mesh's 'stage' axis) "
            f"or 'auto', got {pipeline_stages!r}"
        )
    if pipeline_stages == 1:  # e.g. a sweep over stage counts starting at 1
        warnings.warn(
            "autopar: pipeline_stages=1 is a single stage, no pipeline: planned without one "
            "(grad_accumulation= splits the batch into micro-batches)",
            stacklevel=user_level(),
        )
        pipeline_stages = None
    if pipeline_stages == "auto":
        meshes = _pipeline_meshes(mesh, profile.devices_per_node)
    elif pipeline_stages is not None and (n := _device_count(mesh)) is not None:
        if n % pipeline_stages:
            raise PipelineError(
                f"pipeline_stages={pipeline_stages} on mesh={mesh!r} ({n} devices): the devices "
                f"do not split into {pipeline_stages} equal stages; pass a device count that "
                f"{pipeline_stages} divides, or a mesh with a 'stage' axis"
            )
        shapes = staged_meshes(n, pipeline_stages, profile.devices_per_node)
        meshes = [make_mesh(m) for m in shapes]
    else:
        meshes = resolve(mesh, profile.devices_per_node)
    _warn_idle(fn, meshes)
    if pipeline_schedule not in (None, *SCHEDULES):
        raise PipelineError(
            f"pipeline_schedule={pipeline_schedule!r}{did_you_mean(pipeline_schedule, SCHEDULES)}: "
            f"choose None (1F1B where the step allows it, else GPipe) or one of {SCHEDULES}"
        )
    if virtual_stages is not None and (
        isinstance(virtual_stages, bool)
        or not isinstance(virtual_stages, int)
        or virtual_stages < 2
    ):
        raise PipelineError(
            f"virtual_stages={virtual_stages!r}: give an int >= 2 (layer chunks per stage) "
            "together with pipeline_schedule='interleaved'"
        )
    if virtual_stages is not None and pipeline_schedule != "interleaved":
        raise PipelineError(
            f"virtual_stages={virtual_stages} applies to the interleaved schedule only, and "
            f"pipeline_schedule is {pipeline_schedule!r}: add pipeline_schedule='interleaved'"
        )
    if pipeline_schedule == "interleaved" and virtual_stages is None:
        virtual_stages = 2
    unused = {
        k: v
        for k, v in (("pipeline_schedule", pipeline_schedule), ("microbatches", microbatches))
        if v is not None
    }
    if pipeline_stages is None and unused:
        warnings.warn(
            f"autopar: {', '.join(f'{k}={v!r}' for k, v in unused.items())} "
            f"{'takes' if len(unused) == 1 else 'take'} effect with pipeline_stages=S or "
            "'auto' only; without it no pipeline is planned",
            stacklevel=user_level(),
        )
    given_plan = Plan.load(plan) if isinstance(plan, str | os.PathLike) else plan
    if precision is None and given_plan is not None:
        precision = given_plan.precision
    precision = _precision(precision)
    if grad_accumulation is None and given_plan is not None:
        grad_accumulation = given_plan.grad_accumulation
    if grad_accumulation is not None and (
        not isinstance(grad_accumulation, int) or grad_accumulation < 1
    ):
        raise MicrobatchError(
            f"grad_accumulation must be a positive int (micro-batches per step), got "
            f"{grad_accumulation!r}"
        )
    if grad_accumulation and pipeline_stages:
        raise MicrobatchError(
            "grad_accumulation and pipeline_stages do not combine: a pipeline already "
            "runs its layers micro-batch by micro-batch (set microbatches= instead)"
        )
    if remat is None and given_plan is not None:
        remat = given_plan.remat
    if remat not in (None, "auto", *REMAT_POLICIES):
        raise AutoparError(
            f"remat={remat!r}{did_you_mean(remat, ('auto', *REMAT_POLICIES))}: choose None, "
            f"'auto' or one of {REMAT_POLICIES}"
        )
    if engine != "auto" and engine not in ENGINES:
        raise AutoparError(
            f"unknown engine {engine!r}{did_you_mean(engine, ('auto', *ENGINES))}; choose one "
            f"of: auto, {', '.join(ENGINES)}"
        )
    if time_limit is not None and (
        isinstance(time_limit, bool) or not isinstance(time_limit, int | float) or time_limit <= 0
    ):
        raise AutoparError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    return Options(
        fn=fn,
        keywords=_keyword_only(fn),  # traced as trailing positional arguments
        profile=profile,
        meshes=tuple(meshes),
        engine=engine,
        memory_budget=float(memory_budget) if memory_budget is not None else profile.hbm_bytes,
        static_argnums=tuple(static_argnums),
        donate_argnums=tuple(donate_argnums),
        in_specs=in_specs,
        allow_partial=allow_partial,
        pipeline_stages=pipeline_stages,
        microbatches=microbatches,
        pipeline_schedule=pipeline_schedule,
        virtual_stages=virtual_stages or 1,
        given_plan=given_plan,
        precision=precision,
        grad_accumulation=grad_accumulation,
        remat=remat,
        time_limit=None if time_limit is None else float(time_limit),
        cache_dir=_cache_dir(cache_dir),
        progress=_progress_enabled(progress),
    )


def _device_count(mesh) -> int | None:
    """The device count `mesh` asks autopar to shape (an int, or "auto": all local
    devices); None for a mesh given with its axes."""
    if mesh == "auto":
        return len(jax.devices())
    if isinstance(mesh, int | np.integer) and not isinstance(mesh, bool):
        return int(mesh)
    return None


def _pipeline_meshes(mesh, devices_per_node: int) -> list:
    """The meshes `pipeline_stages="auto"` tries (a device count, or "auto": all)."""
    n = _device_count(mesh)
    if n is None:
        raise PipelineError(
            f"pipeline_stages='auto' searches the mesh shape: pass mesh as a device count "
            f"(or 'auto'), not {mesh!r}; with a fixed mesh, pass pipeline_stages=<its 'stage' size>"
        )
    return [make_mesh(m) for m in pipeline_meshes(n, devices_per_node)]


def _precision(name: str | None) -> str | None:
    """The compute dtype's name for `precision=`: None (as traced), "bfloat16" or
    "float16"."""
    if name is None:
        return None
    aliases = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
    if name not in aliases:
        raise AutoparError(
            f"precision={name!r}{did_you_mean(name, aliases)}: choose None (as traced), "
            "'bf16' or 'fp16'"
        )
    return compute_dtype_of(aliases[name]).name


def parallelize(
    fn: Callable | None = None,
    *,
    mesh: MeshLike,
    cluster: str | os.PathLike | cost_models.ClusterProfile = "h100-sxm",
    engine: str = "auto",
    memory_budget: float | None = None,
    static_argnums: Sequence[int] | int = (),
    static_argnames: Sequence[str] | str = (),
    donate_argnums: Sequence[int] | int = (),
    plan: str | os.PathLike | Plan | None = None,
    in_specs: Any = None,
    allow_partial: bool = False,
    pipeline_stages: int | str | None = None,
    microbatches: int | None = None,
    pipeline_schedule: str | None = None,
    virtual_stages: int | None = None,
    precision: str | None = None,
    grad_accumulation: int | None = None,
    remat: str | None = None,
    time_limit: float | None = None,
    progress: bool | None = None,
    cache_dir: str | os.PathLike | bool | None = None,
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

    Arguments are read as `jax.jit` reads them: `static_argnums` / `static_argnames`
    are static, and so is a value passed by keyword with no array in it (`train=True`);
    defaults the caller did not pass are not traced; Python scalars passed positionally
    are traced. Flax NNX modules, optimizers and `Rngs` anywhere in the arguments are
    traced as their state (named by its paths) and updated in place after the call, as
    `nnx.jit` does; the non-array leaves of an `eqx.Module` are static, as
    `eqx.filter_jit` has them (`autopar.frontends`). A function already wrapped in
    `jax.jit`, `nnx.jit` or `eqx.filter_jit` is unwrapped.

    `pipeline_stages=S` runs every loop over layers (a `scan` whose length S divides,
    e.g. `flax.linen.scan`) as a pipeline over the mesh's `"stage"` axis (of size S)
    with `microbatches` micro-batches per step (default: the best of S, 2S, 4S, 8S and
    12S under the cost model); each stage's layers are searched on the other axes.
    `pipeline_schedule` is "1f1b" (the forward and backward layer loops interleaved in
    one pipeline in lock-step ticks of a forward and a backward slot, each stage
    holding at most 2S - 1 micro-batches' activations), "1f1b-async" (Megatron's 1F1B:
    stages alternate forward and backward half-slots, stage s holds S - s micro-batches,
    each half-slot lasts the slower of the two passes; on XLA:CPU every stage computes
    both passes each half-slot), "zb-h1" (lock-step 1F1B with each backward pass split
    into its input gradient and its weight gradients, the weight gradients deferred
    off the ramp up: S - 1 weight-gradient passes shorter, at the memory of the values
    a deferred pass reads, a ring of min(M, S) micro-batches), "interleaved"
    (lock-step 1F1B over `virtual_stages` chunks of layers per stage, default 2:
    Megatron's interleaving; stage s runs layer chunks s, S + s, ..., so the ramps
    shrink v-fold while the carry hops v times as often; M must be a multiple of S;
    the loop's weights are moved into that order and their gradients back in every
    step, which the plan prices and records; `scan` loops only), "gpipe" (every forward
    pass, then every backward one: M micro-batches' activations) or None: 1F1B where
    the step splits that way, else GPipe. `pipeline_stages="auto"`
    with `mesh` a device count tries every stage count S dividing it, on
    `{"stage": S, "data": ..., "model": ...}` with the model axis
    inside a node (`meshes.pipeline_meshes`; S = 1 is no pipeline), and keeps the
    fastest plan that fits; with no `pipeline_schedule` it also prices each 1F1B
    try's plans under "zb-h1" (the same layouts) and keeps one of those where it is
    faster and fits.

    `precision="bf16"` computes every float32 matmul and convolution on bfloat16
    operands with float32 accumulation, keeping float32 master weights, optimizer
    state and activations (`autopar.passes.precision`). `precision="fp16"` does the same in
    float16, each operand scaled by a power of two into float16's range from its own
    max|x| (per-tensor dynamic scaling, in place of loss scaling: the captured step is
    already differentiated).

    `grad_accumulation=M` cuts the batch (the last non-static argument that is not PRNG
    keys, along its leaves' leading dim) into M micro-batches and runs everything that
    can go micro-batch by micro-batch (forward, backward, up to the gradient sums) in a
    loop over them, then the rest (the optimizer) once (`autopar.passes.accumulate`).

    `remat` rematerializes a layer loop's residuals (`autopar.passes.remat`, layers under a
    `scan`): "dots" keeps only matmul outputs and the layer input, "selective" also
    recomputes the matmul outputs cheapest to recompute per byte (a transformer's
    attention scores), "full" keeps only the layer input, and the backward loop
    recomputes the rest. "auto" tries "none", "dots", "selective", "full" in turn and
    keeps the fastest plan that fits `memory_budget`; it stops early once the budget
    constrained nothing (no mesh shape or pipeline turned away, no ZeRO retry), since
    then more recomputation can only add work.

    `time_limit` (seconds) bounds the search: once it is reached, the best plan found
    so far is returned, with a warning (and a plan warning) naming what was not
    searched (mesh shapes, pipeline tries, remat policies, engines, the latency polish).
    The try under way when the limit passes is finished, and so is the compile check.
    `progress` shows a search that takes more than 2 s on stderr (phase, mesh try k of
    n, elapsed; `autopar.compile.progress`); None follows `AUTOPAR_PROGRESS` (on unless
    0). `cache_dir` keeps searched plans on disk keyed by the traced program, argument
    types, mesh, profile and options, so a later process binds the plan instead of
    searching (`autopar.compile.cache`); None follows `AUTOPAR_CACHE_DIR` (off when
    unset), True is `~/.cache/autopar`, False is off.
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
        virtual_stages=virtual_stages,
        precision=precision,
        grad_accumulation=grad_accumulation,
        remat=remat,
        time_limit=time_limit,
        progress=progress,
        cache_dir=cache_dir,
    )
    if fn is None:
        return lambda f: Parallelized(f, static_argnames=static_argnames, **kw)
    return Parallelized(fn, static_argnames=static_argnames, **kw)


def _keyword_only(fn: Callable) -> tuple[str, ...]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return ()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)


def _hashable(x):
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)
