"""`autopar.parallelize`: what the user holds. `Parallelized` validates the options once,
binds each call's arguments, and keeps one compiled program per argument signature;
`autopar.compile` traces, searches, makes the plan and lowers it."""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

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
from autopar.errors import AutoparError, MeshError, MicrobatchError, PipelineError
from autopar.ir.capture import abstractify_tree, fn_name
from autopar.meshes import MeshLike, make_mesh, pipeline_meshes, resolve
from autopar.passes.pipeline import SCHEDULES
from autopar.passes.precision import compute_dtype_of
from autopar.passes.remat import POLICIES as REMAT_POLICIES
from autopar.plan.plan import Plan
from autopar.search import ENGINES

# bind_plan, compiled_memory and make_plan are re-exported (the CLI, tests, benchmarks)
__all__ = ["Parallelized", "bind_plan", "compiled_memory", "make_plan", "parallelize"]


class Parallelized:
    """What `parallelize` returns: call it like the function, or `.plan()` / `.lower()`."""

    def __init__(self, fn, **options):
        self.fn = fn
        self.options = _options(fn, **options)
        self._cache: dict[Any, Compiled] = {}
        functools.update_wrapper(self, fn)

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
        """Search (or load) the plan for these arguments. Abstract args are fine."""
        return self._get(self._bind(args, kwargs)).plan

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """Lower the sharded program, like `jax.jit(fn).lower(*args)`."""
        call = self._bind(args, kwargs)
        c = self._get(call)
        return lowered(c.jitted, call.flat, c.plan, c.mesh)

    def __call__(self, *args, **kwargs):
        call = self._bind(args, kwargs)
        if isinstance(self.options.meshes[0], AbstractMesh):
            m = self.options.meshes[0]
            raise MeshError(
                f"{fn_name(self.fn)}: the mesh {dict(zip(m.axis_names, m.axis_sizes))} needs "
                f"{math.prod(m.axis_sizes)} devices but only {len(jax.devices())} are available here. "
                "Use .plan() or .lower() to plan offline, or run on a machine with enough devices "
                "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)."
            )
        c = self._get(call)
        flat = call.flat
        for x, r in zip(flat, c.plan.inputs):
            if isinstance(x, jax.Array) and x.is_deleted():
                raise AutoparError(
                    f"{fn_name(self.fn)}: argument {r.path} {r.dtype}{list(r.shape)} was deleted, most "
                    f"likely donated to an earlier call (donate_argnums={self.options.donate_argnums}); "
                    "pass the updated value that call returned instead"
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
    def _bind(self, args: tuple, kwargs: dict) -> Call:
        """The arguments as autopar traces them: keyword arguments bound to their
        positions, then the keyword-only ones in `keywords` order (defaults filled in);
        argnums normalized, donated leaves flattened, `in_specs` covering every
        non-static argument."""
        o = self.options
        args = self._positional(args, kwargs)
        n_pos = len(args) - len(o.keywords)  # what argnums count
        static = _norm(o.static_argnums, n_pos)
        donate = _flat_donate(args, static, _norm(o.donate_argnums, n_pos))
        n_dyn = sum(i not in static for i in range(len(args)))
        specs, n_kw = o.in_specs, len(o.keywords)
        # None (searched) for the keyword-only arguments when it names only the positional ones
        if n_kw and isinstance(specs, tuple | list) and len(specs) == n_dyn - n_kw:
            specs = (*specs, *[None] * n_kw)
        return Call(args, static, donate, specs)

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        keywords = self.options.keywords
        if not kwargs and not keywords:
            return args
        sig = inspect.signature(self.fn)
        try:
            bound = sig.bind(*args, **kwargs)
        except (TypeError, ValueError) as e:  # Python's reason, with the function named
            raise AutoparError(f"{fn_name(self.fn)}: cannot bind the arguments: {e}") from None
        extra = sorted(set(bound.kwargs) - set(keywords))
        if extra:
            raise AutoparError(
                f"{fn_name(self.fn)}: keyword arguments {extra} would go to its **kwargs, which "
                "autopar does not trace; give them parameters of their own or close over them"
            )
        kw = [bound.arguments.get(k, sig.parameters[k].default) for k in keywords]
        return (*bound.args, *kw)

    def _key(self, call: Call):
        leaves, tree = jax.tree_util.tree_flatten(abstractify_tree(call.dyn))
        sig = tuple(
            (tuple(x.shape), str(x.dtype))
            if isinstance(x, jax.ShapeDtypeStruct)
            else ("py", type(x).__name__)
            for x in leaves
        )
        statics = tuple(_hashable(call.args[i]) for i in call.static)
        return (tree, sig, statics)

    def _get(self, call: Call) -> Compiled:
        key = self._key(call)
        if key not in self._cache:
            self._cache[key] = compile_step(self.options, call)
        return self._cache[key]


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
    precision=None,
    grad_accumulation=None,
    remat=None,
) -> Options:
    """`parallelize`'s options, checked and resolved (meshes, profile, a plan file,
    defaults from a given plan), in one place."""
    profile = cost_models.load(cluster)
    if pipeline_stages == "auto":
        meshes = _pipeline_meshes(mesh, profile.devices_per_node)
    else:
        meshes = resolve(mesh, profile.devices_per_node)
    if pipeline_stages not in (None, "auto") and (
        not isinstance(pipeline_stages, int) or pipeline_stages < 1
    ):
        raise PipelineError(
            f"pipeline_stages must be a positive int (the size of the mesh's 'stage' axis) "
            f"or 'auto', got {pipeline_stages!r}"
        )
    if pipeline_schedule not in (None, *SCHEDULES):
        raise PipelineError(
            f"pipeline_schedule={pipeline_schedule!r}: choose None (1F1B where the step "
            f"allows it, else GPipe) or one of {SCHEDULES}"
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
        raise AutoparError(f"remat={remat!r}: choose None, 'auto' or one of {REMAT_POLICIES}")
    if engine != "auto" and engine not in ENGINES:
        raise AutoparError(f"unknown engine {engine!r}; choose one of: auto, {', '.join(ENGINES)}")
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
        given_plan=given_plan,
        precision=precision,
        grad_accumulation=grad_accumulation,
        remat=remat,
    )


def _pipeline_meshes(mesh, devices_per_node: int) -> list:
    """The meshes `pipeline_stages="auto"` tries (a device count, or "auto": all)."""
    if mesh == "auto":
        mesh = len(jax.devices())
    if not isinstance(mesh, int) or isinstance(mesh, bool):
        raise PipelineError(
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


def _keyword_only(fn: Callable) -> tuple[str, ...]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some callables have no signature
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
