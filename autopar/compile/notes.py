"""The plan notes the driver writes about what it tried: the pipelines of
`pipeline_stages="auto"`, the mesh shapes a screen left out, and the warning on an
offline plan that was never compiled."""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax

from autopar.compile.calls import pipeline_of
from autopar.errors import format_bytes
from autopar.lower.devices import branches
from autopar.passes.pipeline import PipelinedScans
from autopar.plan.plan import Plan


def unbranched(pipelined: PipelinedScans, mesh) -> str | None:
    """The warning on an alternating 1F1B plan lowered without branches (XLA:CPU
    devices, `autopar.lower.pipeline.branches`): the program runs more than it prices."""
    if pipelined.pipe.schedule != "1f1b-async" or branches(mesh):
        return None
    return (
        "on XLA:CPU devices the alternating 1F1B runs every stage's forward and backward "
        "pass in every half-slot and keeps the one its slot holds (a collective inside a "
        "branch that only some devices take hangs there): about twice the compute the "
        "plan prices, and more memory (2 stages of 2 layers: compiled temporaries 1.29x "
        "the prediction); GPUs run the branching program the plan prices"
    )


def unpipelined_stacks(stacks, rolled) -> str | None:
    """The warning on a pipeline of one stack of layers unrolled in Python where the step
    has others (an encoder-decoder's decoder): they run between the loops, on the last
    stage, with the loss."""
    others = [s.describe() for s in stacks if s.template != rolled.template]
    if not others:
        return None
    return (
        f"the pipeline's stages run the layer stack {rolled.template} only; "
        f"{'; '.join(others)} (unrolled in Python) {'is' if len(others) == 1 else 'are'} "
        "not pipelined: one stack a step is rolled into the stages' loops, and the ops "
        "between the loops run on the last stage"
    )


def plan_warnings(graph, plan, options, pipelined, mesh, stacks) -> list[str]:
    """What a plan warns of, beyond its search's notes: micro-batches too small to split
    (`grad_accumulation`), and a pipeline's random draws, unbranched schedule, fallback
    to GPipe, unpipelined stacks and layers outside its stages (`stacks`: the step's
    stacks unrolled in Python, where it rolled one)."""
    whys = [
        replicated_microbatches(graph, plan, options.grad_accumulation),
        replicated_data(plan, options.engine),
        ilp_unproven(plan, options.engine),
        idle_axes(plan),
    ]
    if pipelined is not None:
        rolled = pipelined.roll
        whys += [
            random_per_microbatch(pipelined),
            unbranched(pipelined, mesh),
            pipelined.fallback,
            rolled and unpipelined_stacks(stacks, rolled),
            rolled and outside_layers(stacks, rolled, pipelined.pipe.stages),
        ]
    return [w for w in whys if w]


def idle_axes(plan) -> str | None:
    """The plan warning of mesh axes that no array of the plan is split or summed over,
    where another axis is: their devices repeat each other's work (a DLRM-style step on
    data 32 x model 8 left `data` idle; only `inspect` showed it). A plan that splits
    nothing is the summary's `work:` line's (and `unsplittable`'s) to say."""
    used: set[str] = set()

    def walk(ops) -> None:
        for op in ops:
            for sp in (*op.in_specs, *op.out_specs):
                used.update((*sp.used_axes, *sp.partial))
            for inner in [op.body] if op.body is not None else list(op.branches or ()):
                used.update(a for r in (*inner.inputs, *inner.outputs) for a in r.spec.used_axes)
                walk(inner.ops)

    walk(plan.ops)
    used.update(a for r in (*plan.inputs, *plan.outputs) for a in r.spec.used_axes)
    used.add((plan.pipeline or {}).get("axis", ""))  # the stages': the pipeline's own
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    idle = [f"{a!r} ({n} devices)" for a, n in sizes.items() if n > 1 and a not in used]
    if not idle or not any(n > 1 and a in used for a, n in sizes.items()):
        return None
    return (
        f"the plan splits nothing over mesh axis {' and '.join(idle)}: every op runs whole "
        "along it, so those devices repeat each other's work (no dim divides by its size, "
        "or no split along it pays for its communication); a mesh without that axis runs "
        "the same step on fewer devices, and mesh=N searches the shape"
    )


def replicated_data(plan, engine: str) -> str | None:
    """engine="data" asked for, that could split no batch over the mesh: the plan runs
    (mostly) replicated, which only the summary's `work:` line said (where nothing at
    all divides, the search's own warning says so)."""
    share = plan.replicated_share()
    if engine != "data" or share is None or share <= 0.5:
        return None
    if any(w.startswith("nothing in ") for w in plan.warnings):
        return None
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    return (
        f"engine='data' found no batch dim that divides over the mesh {sizes}: "
        f"{100 * share:.0f}% of the step's compute runs replicated (whole on every "
        "device); a batch the data axes divide, or engine='auto' (which may split the "
        "weights instead), shards it"
    )


def ilp_unproven(plan, engine: str) -> str | None:
    """engine="ilp" asked for, stopped at its time limit without proving its plan
    optimal: the yardstick's plan is then only as good as HiGHS got (a Whisper-style
    step's was 3.9x `auto`'s), which only the summary's search line said."""
    info = plan.search_info.get("ilp", {})
    if engine != "ilp" or info.get("optimal", True):
        return None
    gap = info.get("gap")
    return (
        "engine='ilp' stopped at its time limit without proving its plan optimal"
        + (f" (gap {gap:.1%} under the cost model)" if isinstance(gap, float) else "")
        + ": the plan may be far from the best one; engine='auto' (the default) searches "
        "this step faster"
    )


def replicated_microbatches(graph, plan, microbatches: int | None) -> str | None:
    """The warning on a gradient accumulation plan that runs most of its compute whole
    on every device while a micro-batch has fewer examples than the mesh has devices:
    the micro-batches are too small to split over them."""
    from autopar.passes.accumulate import is_accumulation

    share = plan.replicated_share()
    if not microbatches or microbatches < 2 or share is None or share <= 0.5:
        return None
    loop = next((n for n in graph.nodes if is_accumulation(n)), None)
    if loop is None:
        return None
    n_fixed = loop.params["num_consts"] + loop.params["num_carry"]
    sizes = [t.shape[0] for v in loop.body.inputs[n_fixed:] if (t := loop.body.values[v]).rank]
    examples = max((b for b in sizes if b), default=0)
    devices = plan.mesh.num_devices
    if not examples or examples >= devices:
        return None
    batch = examples * microbatches
    # the most micro-batches that still give every device an example
    fewer = next(
        (m for m in range(microbatches - 1, 0, -1) if not batch % m and batch // m >= devices), None
    )
    if fewer is None:
        hint = ""
    elif fewer == 1:
        hint = f"; without accumulation the batch of {batch} splits over them"
    else:
        hint = f"; grad_accumulation={fewer} (micro-batches of {batch // fewer}) would split them"
    return (
        f"gradient accumulation: a micro-batch has {examples} examples for {devices} "
        f"devices, and {100 * share:.0f}% of the step's compute runs replicated (whole on "
        "every device): the micro-batches may be too small to split well over the mesh" + hint
    )


def outside_layers(stacks, rolled, stages: int) -> str | None:
    """The warning on a pipeline whose stack of layers unrolled in Python does not split
    into its stages: its first layers run outside it (`LayerStack.split_into`)."""
    for s in stacks:
        r = len(s.forward) - rolled.layers
        if s.template == rolled.template and r > 0:
            first, last = s.forward[0].index, s.members(s.forward[r - 1])[-1]
            return (
                f"layer{'s' * (last > first)} {first}"
                + (f"..{last}" if last > first else "")
                + f" of {s.template} run{'s' * (last == first)} outside the pipeline, before "
                f"its first stage, as the step's other ops do (searched on the whole mesh): its "
                f"{stages} equal stages take {rolled.layers} of the {len(s.forward)} "
                + ("units" if s.period > 1 else "layers")
            )
    return None


def pipeline_tries(options, failures, repriced: bool = False, one_loop: int = 0) -> str:
    """The plan note of `pipeline_stages="auto"`: the best plan of every (mesh,
    micro-batch count) tried, and the meshes that had none; with `repriced`, a ZB-H1
    entry is a lock-step try's plans priced again (`_Driver._other_schedule`); with
    `one_loop`, the tries were priced on that many unrolled layers rolled into one loop
    (`compile.pipelines.proxied`)."""
    best: dict[str, float] = {}
    for step_s, _, _, mesh, _, _, tried in options:
        pipelined = pipeline_of(tried)
        shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
        key = f"{shape}" + (f" M={pipelined.pipe.microbatches}" if pipelined else "")
        if repriced and pipelined is not None and pipelined.pipe.schedule == "zb-h1":
            key += " |zb-h1"  # also the same try's plans re-priced (`_other_schedule`)
        best.setdefault(key, step_s)
    tried = [
        f"{k.split(' |')[0]} {v * 1e3:.4g} ms" + (" under zb-h1" if " |" in k else "")
        for k, v in best.items()
    ]
    how = (
        f" (priced on the {one_loop} layers unrolled in Python rolled into one loop over "
        "them, one layer a step, as under scan; the plan's try was searched again as it "
        "runs: rolled into loops over its stages, or its layers unrolled without a pipeline)"
        if one_loop
        else ""
    )
    return f"pipeline_stages='auto' tried{how} (fastest first): " + "; ".join(
        tried + list(dict.fromkeys(f.splitlines()[0].rstrip(":") for f in failures))
    )


def over_floor(name: str, need: float, budget: float) -> str:
    """Why a try was dropped unbuilt: its `search.evaluate.memory_floor` is above the
    budget."""
    return (
        f"{name}: no plan fits the memory budget of {format_bytes(budget)} per device; "
        f"every plan needs at least {format_bytes(need)} (the arguments and what no "
        "fusion keeps out of memory, split over every device: "
        "`search.evaluate.memory_floor`)"
    )


def floored_note(skipped: int, tries: int) -> str:
    """The plan note on the tries the FLOP floor left out (`compile.driver`)."""
    return (
        f"{skipped} of {tries} (mesh, micro-batch count) tries not searched: all their FLOPs "
        "at the profile's peak rate already take longer than the best plan found "
        "(`search.problem.step_floor`)"
    )


def screen_note(tries, screen: dict, dropped: list, same: dict, best: float, margin: float) -> str:
    """The plan note of a screened mesh-shape search: the shapes not searched in full,
    with the price of their `recursive` plan, and those that are one mesh to the cost
    model with a shape searched."""
    shape = lambda i: dict(zip(tries[i][1].axis_names, tries[i][1].axis_sizes))  # noqa: E731
    parts = []
    if dropped:
        names = [f"{shape(i)} {screen[i] * 1e3:.4g} ms" for i in sorted(dropped, key=screen.get)]
        parts.append(
            f"{len(dropped)} whose `recursive` plan is priced above {margin:g}x the best plan "
            f"found ({best * 1e3:.4g} ms): " + ", ".join(names)
        )
    if same:
        parts.append(
            f"{len(same)} the same mesh to the cost model as a shape searched, its axes "
            "relabeled (the same sizes and node boundaries, under other names): "
            + ", ".join(f"{shape(i)} as {shape(j)}" for i, j in sorted(same.items()))
        )
    return f"mesh-shape search over {len(tries)} shapes, not searched in full: " + "; ".join(parts)


def grouped(reasons: Sequence[str], sep: str = ": ", kept: str = "") -> list[str]:
    """`what{sep}why` lines, those of one `why` joined into one (`what, what{sep}why`), in
    order of first appearance: a refusal that every mesh (or micro-batch count) gives
    alike is said once. `kept`: the head of `sep` that belongs to `what` (a mesh's `}`)."""
    by: dict[str, list[str]] = {}
    for r in reasons:
        what, found, why = r.partition(sep)
        by.setdefault(why if found else "", []).append(what + kept if found else r)
    rest = sep[len(kept) :]
    return [f"{', '.join(w)}{rest}{why}" if why else ", ".join(w) for why, w in by.items()]


def held_back(plan: Plan, budget: float) -> bool:
    """Whether memory held `plan` back: a faster plan was found over the budget
    (`remat="auto"` then tries the next policy: a trial's 8B step kept remat=none's
    plan, 1.47x dearer than dots')."""
    return any(
        c.step_s < plan.cost.step_s and c.peak_memory_bytes > budget
        for c in plan.candidates.values()
    )


def no_pipeline_why(failures) -> str:
    """The plan warning of `pipeline_stages="auto"` when no pipeline could be made: why
    each mesh with a stage axis was turned away."""
    reasons = []
    meshes: dict[str, list[str]] = {}  # reason -> the meshes it turned away
    for f in failures:
        if "stage" in f:
            first, *rest = [x.strip() for x in f.splitlines() if x.strip()]
            text = " ".join([first, "; ".join(rest)]) if rest else first  # one per count
            shape, _, reason = text.partition("}: ")
            reason = re.sub(r"^\d+ stages: ", "", reason)
            meshes.setdefault(reason, []).append(shape + "}")
    reasons += [f"{', '.join(m)}: {r}" for r, m in meshes.items()]
    return "pipeline_stages='auto' returned an unpipelined plan: " + (
        "; ".join(reasons) or "no mesh with a 'stage' axis was tried"
    )


def offline_warning(plan: Plan, budget: float) -> str:
    """The plan warning of a plan made on a mesh with no devices here (an AbstractMesh)
    that comes close to the memory budget: it was not compile-checked."""
    peak = plan.cost.peak_memory_bytes
    return (
        f"not compile-checked: planned on a mesh with no devices here ({plan.mesh.shape}, "
        f"{plan.mesh.num_devices} devices; this machine has {len(jax.devices())}), and its "
        f"predicted peak {format_bytes(peak)}/device is {peak / budget:.0%} of the memory "
        f"budget {format_bytes(budget)}; XLA's own temporaries come on top of that. Check it "
        "with `autopar verify PLAN TARGET` (compiles the plan for the whole mesh on simulated "
        "CPU devices), or compile the same per-device shapes on a smaller mesh"
    )


def no_layer_loop(near: str | None = None) -> str:
    """Why a graph offers no layers to pipeline: neither a loop nor a stack unrolled
    in Python (`passes.stacks` found none); `near`, `stacks.why_no_stack`'s reason."""
    if near:
        return f"it has no loop over layers, and no stack of layers unrolled in Python: {near}"
    return (
        "it has no loop over layers and no stack of repeated layers unrolled in Python was "
        "found (layers are told apart by their parameters' paths: `h_0`, `layers/3`, ...; "
        "a loop is flax.linen.scan, nnx.scan or jax.lax.scan over stacked weights)"
    )


def unsplittable(problem, name: str) -> str | None:
    """The plan warning of a mesh of several devices on which no op of the step can be
    split (no dim of any array divides by an axis's size): every device runs the whole
    step. None where something can be split."""
    mesh = problem.mesh
    if mesh.num_devices <= 1:
        return None
    tables = {id(t): t for t in problem.strategies}.values()  # repeated layers share theirs
    # a pending sum alone splits nothing: summands of a whole value are whole-sized
    if any(sp.used_axes for t in tables for st in t for sp in st.out_specs):
        return None
    sizes = " x ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.axis_sizes))
    return (
        f"nothing in {name} can be split on the mesh {sizes}: no dimension of its arrays "
        "divides by a mesh axis's size, so every device runs the whole step (correct, and "
        "no faster than one device); give the mesh axis sizes that divide the batch or "
        "the hidden sizes"
    )


RANDOM_OPS = ("random_bits", "rng_bit_generator", "rng_uniform")


def random_per_microbatch(pipelined: PipelinedScans) -> str | None:
    """Why a pipelined step's random numbers (dropout masks) differ from `jax.jit`'s:
    the loop bodies and the 1F1B head draw them per micro-batch, at the micro-batch's
    shape with its index folded into the key (`autopar.ir.eval.drawn_per_microbatch`),
    so the draw is another one (as random); None when they draw none."""
    bodies = [body for body, _ in pipelined.scans.values()]
    ops = [n for b in bodies for n in b.nodes] + [n for f in pipelined.fused for n in f.micro_nodes]
    drawn = sorted({n.key for n in ops if n.op in RANDOM_OPS})
    if not drawn:
        return None
    return (
        f"random numbers are drawn per micro-batch inside the pipeline ({drawn[0]}"
        + (f" and {len(drawn) - 1} more" if len(drawn) > 1 else "")
        + ", the micro-batch's index folded into the key): dropout masks are a different "
        "(equally random) draw than jax.jit's, so steps match jax.jit only in "
        "distribution; set the dropout rate to 0 to compare numbers"
    )


def weak_types_changed(keys, key, dyn) -> str | None:
    """Why a call plans again where an earlier call's arguments differ from this one's
    only in which leaves are weakly typed (`jnp.full(shape, 0.1)` without a dtype is;
    the optimizer's update returns it strong): its leaves, named; None otherwise.
    `keys`: the cached calls' keys, each (program, treedef, leaf signatures, statics)
    as `key` is; `dyn`: this call's dynamic arguments."""
    import jax

    strip = lambda sig: tuple(s[:2] if len(s) == 3 else s for s in sig)  # noqa: E731
    prog, tree, sig, statics = key
    for k in keys:
        if k[0] == prog and k[1] == tree and k[3] == statics and strip(k[2]) == strip(sig):
            paths = [
                jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dyn)[0]
            ]
            moved = [p for p, a, b in zip(paths, k[2], sig) if a != b]
            shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
            return (
                f"planning and compiling again: argument leaves {shown} changed between weakly "
                "and strongly typed since an earlier call (an array made without a dtype, "
                "`jnp.full(shape, 0.1)`, is weakly typed; the optimizer's update returns it "
                "strong), which jax.jit also traces apart; give them a dtype "
                "(`jnp.full(shape, 0.1, jnp.float32)`) to plan once"
            )
    return None
