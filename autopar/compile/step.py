"""One call's plan: `compile_step` traces the function once, answers with an earlier
call's plan where it traced to the same program, or from the plan cache
(`compile.cache`) when it holds the plan, else runs the driver (`compile.driver`,
each remat policy in turn with `remat="auto"`) and stores what it found. The plan
records the seconds of each phase (`compile.clock`); under `time_limit=` the work left
out is named in a warning and in the plan, and such a plan is not cached."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Sequence
from dataclasses import replace

import jax

from autopar.compile.cache import PlanCache, cache_key, described_key, program_hash
from autopar.compile.calls import Call, Compiled, Options, Proxy
from autopar.compile.clock import Clock
from autopar.compile.driver import Infeasible, _Driver, log
from autopar.compile.tries import Earlier
from autopar.errors import BUDGET_HINT, AutoparError, MemoryBudgetError, user_level
from autopar.ir.capture import abstractify_tree, capture, fn_name
from autopar.ir.graph import Graph
from autopar.passes.pipeline import Pipeline, check_stage_axis
from autopar.passes.remat import POLICIES as REMAT_POLICIES
from autopar.plan.plan import Plan
from autopar.sharding import mesh_info


def compile_step(
    options: Options, call: Call, source: str | None = None, earlier: Sequence[Compiled] = ()
) -> Compiled:
    """The plan and `jax.jit` for this call: the plan of an `earlier` call (of the same
    function) whose trace is the same program (`_same_program`), else from the plan
    cache when it has one for it (`compile.cache`), else searched (and stored there).
    The plan records the seconds of each phase; under `time_limit=` the work left out
    is named in a warning (and the plan is not stored). `source`: the call's
    trace-free key (`cache.source_key`), pointed at the entry for `.plan()` in later
    processes.

    Python's full garbage collections walk every object it tracks; planning makes
    millions of short-lived ones, which trigger them, while the objects that are there
    to stay (JAX's, the captured graph) make each walk long: on GPT-3 175B unrolled
    (`recursive`) 15 full collections took 2.3 of 13.6 s. So what exists before
    planning and after the capture is frozen (`gc.freeze`: left out of collections;
    freed by reference counting as ever) for the planning's duration, and put back
    after it (0.25 -> 0.05 s on the 7B Llama-style step, 2.3 -> 1.1 s on 175B)."""
    gc.freeze()
    try:
        return _compile_step(options, call, source, earlier)
    except MemoryBudgetError as e:
        unused = budget_options(options)
        if BUDGET_HINT not in e.message or not unused:
            raise
        hint = f"{BUDGET_HINT[:-1]}; or try {unused}."
        raise type(e)(e.message.replace(BUDGET_HINT, hint)) from None
    finally:
        gc.unfreeze()


def budget_options(options: Options) -> str:
    """The options that cut memory and this call did not use, as a hint."""
    out = []
    if options.remat in (None, "none"):
        out.append("remat='auto' (recompute activations in the backward pass)")
    if not options.donate_argnums:
        out.append("donate_argnums for the train state (its update written into its buffers)")
    if options.pipeline_stages is None and options.grad_accumulation is None:
        out.append("grad_accumulation=M (one micro-batch's activations at a time)")
        out.append("pipeline_stages=S with a 'stage' mesh axis (a stage's layers per device)")
    if len(out) < 2:
        return "".join(out)
    return ", ".join(out[:-1]) + " or " + out[-1]


def _compile_step(options: Options, call: Call, source: str | None, earlier) -> Compiled:
    clock = Clock(options.time_limit)
    single = len(options.meshes) == 1
    if isinstance(options.pipeline_stages, int):  # a mesh without its stage axis: say so
        for mesh in options.meshes:  # before tracing (seconds on a large model)
            info = mesh_info(mesh, options.profile.devices_per_node)
            check_stage_axis(Pipeline(options.pipeline_stages, 1), info)
    log.info("tracing %s", fn_name(options.fn))
    with clock.phase("capture"):
        graph = capture(
            options.fn,
            call.args,
            call.static,
            options.meshes[0] if single else None,
            options.keywords,
        )
    gc.freeze()  # the captured graph stays for the whole planning (`compile_step`)
    mine = {"traced": graph, "described": described_key(options, call)}
    same = _same_program(graph, mine["described"], earlier)
    got = None
    if same is not None:  # its warnings were given for the earlier call: in its plan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _cached(options, call, graph, clock, same.plan)
    if got is not None:
        log.info("%s: the same program as an earlier call's: its plan", fn_name(options.fn))
        return replace(got, plan=replace(got.plan, phases=clock.report()), **mine)
    cache = key = parts = None
    if options.cache_dir is not None and options.given_plan is None:
        cache = PlanCache(options.cache_dir)
        with clock.phase("cache"):
            key, parts = cache_key(options, call, graph)
            hit = cache.load(key, graph.name)
        if hit is not None:
            got = _cached(options, call, graph, clock, hit)
            if got is not None:
                info = {"status": "hit", "path": str(cache.path(key, graph.name))}
                if hit.phases and "total" in hit.phases:
                    info["searched_s"] = hit.phases["total"]
                if source is not None:
                    cache.store_alias(source, key, got.plan)
                _warn_unsupported(options, got.plan)
                plan = replace(got.plan, phases=clock.report(), cache=info)
                return replace(got, plan=plan, **mine)
    got = _compile(options, call, graph, clock)
    _warn_unsupported(options, got.plan)
    if clock.skipped:
        note = (
            f"time_limit={options.time_limit:g} s reached after {clock.elapsed():.1f} s: this is "
            "the best plan found; not searched: " + "; ".join(clock.skipped)
        )
        warnings.warn(f"autopar: {fn_name(options.fn)}: {note}", stacklevel=user_level())
        got = replace(got, plan=replace(got.plan, warnings=(*got.plan.warnings, note)))
    workers = {k: round(v, 6) for k, v in clock.workers.items()} or None
    plan = replace(got.plan, phases=clock.report(), worker_phases=workers)
    if cache is not None and not clock.skipped:
        with clock.phase("cache"):
            path = cache.store(key, plan, parts)
            if path is not None and source is not None:
                cache.store_alias(source, key, plan)
        plan = replace(
            plan, cache={"status": "stored" if path else "not stored", "path": str(path or "")}
        )
        plan = replace(plan, phases=clock.report())
    return replace(got, plan=plan, **mine)


def _same_program(graph: Graph, described: str, earlier) -> Compiled | None:
    """The `earlier` call (of the same parallelized function) whose options and trace
    are this call's (`cache.cache_key`'s parts), or None. A call misses the compiled
    programs' cache when anything static in its arguments differs, as `jax.jit`'s does:
    a flax `TrainState` made again holds a new optax transformation (functions, equal
    by identity), a rebuilt NNX model new graph nodes. `jax.jit` traces and compiles
    again; a search is more: the same program takes the plan made (bound to this trace
    as a given plan is). A program is hashed only when a later call asks."""
    mine = None
    for c in earlier:
        if c.traced is None or c.described != described:
            continue
        if c.program is None:
            c.program = program_hash(c.traced)
        mine = mine or program_hash(graph)
        if c.program == mine:
            return c
    return None


def _warn_unsupported(options: Options, plan: Plan) -> None:
    """The ops with no sharding rule (they run replicated), as one Python warning."""
    ops = [w for w in plan.warnings if w.startswith("no sharding rule")]
    if ops:
        more = f" (and {len(ops) - 3} more)" if len(ops) > 3 else ""
        warnings.warn(
            f"autopar: {fn_name(options.fn)}: " + "; ".join(ops[:3]) + more, stacklevel=user_level()
        )


def plan_by_source(options: Options, call: Call, source: str | None) -> Plan | None:
    """`.plan()` without tracing: the plan the trace-free key `source` points at in the
    plan cache (stored by an earlier `compile_step` of the same call), or None. Calls
    never take this path: they trace, and bind the plan the traced key finds."""
    if options.cache_dir is None or options.given_plan is not None or source is None:
        return None
    clock, cache = Clock(), PlanCache(options.cache_dir)
    with clock.phase("cache"):
        got = cache.load_alias(source, fn_name(options.fn))
    if got is None:
        return None
    key, plan, out_tree = got
    shape = dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    meshes = [m for m in options.meshes if dict(zip(m.axis_names, m.axis_sizes)) == shape]
    info = {
        "status": "hit",
        "key": "source",
        "path": str(cache.path(key, plan.function)),
    }
    if plan.phases and "total" in plan.phases:
        info["searched_s"] = plan.phases["total"]
    return replace(
        plan,
        in_tree=jax.tree_util.tree_structure(abstractify_tree(call.dyn)),
        out_tree=out_tree,
        jax_mesh=meshes[0] if meshes else None,
        phases=clock.report(),
        cache=info,
    )


# How far above the fastest policy's price (as priced on an unrolled stack rolled into
# one loop, `compile.pipelines.proxied`) another policy's plan is searched again as it
# runs too: the one-loop price was measured up to 1.7% off the price of the same try
# searched as it runs (docs/algorithms.md, "Pipelining layers unrolled in Python").
ONE_LOOP_MARGIN = 0.02

# Searches `remat="auto"` spends on how many layers of an unrolled stack to recompute
# (bisection: the count is known to within depth / 2**MAX_LAYER_PROBES).
MAX_LAYER_PROBES = 4


def _fewest_layers(
    options: Options,
    call: Call,
    policy: str,
    graph: Graph,
    clock: Clock,
    got: Compiled | Proxy,
    driver: _Driver,
    tried: list[str],
    bound: float = float("inf"),
) -> Compiled | Proxy:
    """`policy` fits on every layer of the unrolled stack and no lighter policy fits:
    the fastest plan recomputing only the stack's first layers, the fewest that fit
    (each layer recomputed costs its forward again). Bisection on the count, one
    search a probe; the memory a count saves grows with it. `bound`: the step time of
    a plan already made (a probe's plans no faster are not compiled to check them)."""
    lo, hi, best = 0, driver.stack_layers, got  # 0 layers is remat=none, which did not fit
    for _ in range(MAX_LAYER_PROBES):
        if hi - lo <= 1 or clock.out_of_time():
            break
        mid = (lo + hi) // 2
        probe = _Driver(
            options,
            call,
            policy,
            graph,
            clock,
            remat_layers=mid,
            traces=driver.traces,
            bound=min(bound, _made_bound([best])),
        ).compile()
        if isinstance(probe, Infeasible):
            tried.append(f"remat={policy} on the first {mid} layers: {probe.brief}")
            lo = mid
            continue
        tried.append(f"remat={policy} on the first {mid} layers: {_priced(probe)}")
        hi = mid
        if probe.step_s < best.step_s:
            best = probe
    return best


def fastest_made(found: list, tried: list[str]) -> Compiled | None:
    """The fastest of the remat policies' plans `found`, fastest first. A plan priced on
    an unrolled stack rolled into one loop (`Proxy`) is made by searching its try again
    as it runs; so is every one priced within ONE_LOOP_MARGIN of the fastest plan made,
    and the next one where none fits. What each such search gave goes to `tried`."""
    made = None
    for got in sorted(found, key=lambda c: c.step_s):
        if made is not None and got.step_s > made.step_s * (1 + ONE_LOOP_MARGIN):
            break
        if isinstance(got, Proxy):
            policy, got = got.remat or "none", got.realize()
            if isinstance(got, Infeasible):
                tried.append(f"remat={policy} searched again: {got.brief}")
                continue
            tried.append(f"remat={policy} searched again: {got.step_s * 1e3:.4g} ms")
        made = got if made is None or got.step_s < made.step_s else made
    return made


def _made_bound(found: list) -> float:
    """The step time of the fastest plan made among `found` (not one priced on a
    stack rolled into one loop, `Proxy`, whose price is approximate): a later try's
    plans no faster need no compile check."""
    return min((g.step_s for g in found if isinstance(g, Compiled)), default=float("inf"))


def _priced(got: Compiled | Proxy) -> str:
    """A policy's best price, as the `remat='auto'` note gives it."""
    one = " as priced with the layers in one loop" if isinstance(got, Proxy) else ""
    return f"{got.step_s * 1e3:.4g} ms{one}"


def _cached(options: Options, call: Call, graph: Graph, clock: Clock, plan: Plan):
    """The cached `plan` bound to this trace (the passes it was made after run again), or
    None when it does not bind (then the search runs)."""
    try:
        got = _Driver(
            replace(options, given_plan=plan, allow_partial=False), call, plan.remat, graph, clock
        ).compile()
    except AutoparError as e:
        log.warning("autopar plan cache: the cached plan does not bind (%s); searching", e)
        return None
    return None if isinstance(got, Infeasible) else got


def _compile(options: Options, call: Call, graph: Graph, clock: Clock) -> Compiled:
    """The searched plan and `jax.jit` for this call. With `remat="auto"`, each policy
    in turn from the least recompute, keeping the fastest plan that fits."""
    if options.remat != "auto":
        got = _Driver(options, call, options.remat, graph, clock).compile()
        got = got.realize() if isinstance(got, Proxy) else got
        if isinstance(got, Infeasible):
            raise got.error
        return got
    tried, best, traces, found, bisect, earlier = [], None, {}, [], None, Earlier()
    for k, policy in enumerate(REMAT_POLICIES):  # most memory, least recompute first
        if best is not None and clock.out_of_time():
            clock.skip("remat policies " + ", ".join(REMAT_POLICIES[k:]))
            break
        bound = _made_bound(found)
        driver = _Driver(options, call, policy, graph, clock, None, traces, bound, earlier)
        got = driver.compile()
        if isinstance(got, Infeasible):
            if not got.memory:  # not memory: no policy changes it
                raise got.error
            tried.append(f"remat={policy}: {got.brief}")
            continue
        left = f" ({earlier.left[policy]})" if policy in earlier.left else ""
        tried.append(f"remat={policy}: {_priced(got)}{left}")
        if best is None and k > 0 and driver.stack_layers > 1 and driver.unpipelined_fits:
            # the policy before did not fit: fewer layers of this one may (recomputing
            # less); bisect on how many of the unrolled stack's first layers it covers,
            # once the other policies are tried (the fastest plan made then spares the
            # probes' slower plans their compile checks). Not where it fits only
            # pipelined: a pipeline recomputes all its layers or none, and fewer layers
            # hold more memory than all of them, which did not fit
            bisect = (policy, driver, got)
        found.append(got)
        # (a price on one loop, `Proxy`, may be realized up to the margin dearer, and a
        # later policy's try within it is then made too: `fastest_made`)
        margin = 1 + ONE_LOOP_MARGIN if isinstance(got, Proxy) else 1
        earlier.best = min(earlier.best, got.step_s * margin)
        if best is None or got.step_s < best.step_s:
            best = got
        if not got.memory_bound:  # nothing held back by memory: more remat only adds work
            break
        if policy != "none" and got.remat is None:  # nothing to rematerialize
            tried.append("no layers to rematerialize")
            break
    if bisect is not None and not clock.out_of_time():
        policy, driver, got = bisect
        bound = _made_bound(found)
        fewer = _fewest_layers(options, call, policy, graph, clock, got, driver, tried, bound)
        if fewer is not got:
            found.append(fewer)
    made = fastest_made(found, tried)
    if made is not None:
        note = "remat='auto' tried " + "; ".join(tried)
        return replace(made, plan=replace(made.plan, warnings=(*made.plan.warnings, note)))
    raise MemoryBudgetError(
        f"{fn_name(options.fn)}: no rematerialization policy fits the budget:\n  "
        + "\n  ".join(tried)
    )
