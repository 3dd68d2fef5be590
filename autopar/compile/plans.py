"""Plans from search results, and loaded plans bound to a trace: `make_plan` records a
chosen strategy per op (scan bodies and cond branches nested), `bind_plan` checks a
plan against the traced function, and the pins turn user-fixed or reused argument
specs into strategy indices for the search."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autopar.cost.model import matmul_rates
from autopar.errors import MeshError, PlanError, did_you_mean
from autopar.ir._compat import broadcast_prefix
from autopar.ir.graph import Graph
from autopar.lower.rolled import member_spec
from autopar.passes.pipeline import PipelinedScans, layer_ranges
from autopar.passes.roll import Roll
from autopar.plan.plan import Plan, fingerprint, op_keys
from autopar.plan.records import BodyRecord, OpRecord, TensorRecord
from autopar.search.evaluate import output_specs
from autopar.search.layers import op_layer_names
from autopar.search.piped import moved_cost, weight_slot_seconds
from autopar.search.problem import Problem
from autopar.sharding import MeshInfo, Spec


def user_pins(
    problem: Problem, dyn_args: tuple, in_specs: Any, roll: Roll | None = None, axis: str = ""
) -> dict[int, int] | MeshError:
    """Cost-graph pins for the argument specs the user fixed (`in_specs=`), or the
    MeshError naming the spec this mesh cannot apply (the caller raises it when the
    mesh was the only one to try). On a graph whose unrolled layers `roll` rolled into
    loops over stages, a group's pin is its layers' one spec with dim 0 split over the
    stage axis `axis` first (`rolled_specs`)."""
    from jax.sharding import PartitionSpec

    is_leaf = lambda x: x is None or isinstance(x, PartitionSpec)
    if isinstance(in_specs, list):  # one per argument, as jax.jit reads in_shardings
        in_specs = tuple(in_specs)
    if isinstance(in_specs, tuple) and len(in_specs) != len(dyn_args):
        return MeshError(
            f"in_specs has {len(in_specs)} entries but the function takes {len(dyn_args)} "
            "(non-static) arguments: give one PartitionSpec (or a pytree of them, or None) "
            "per argument"
        )
    try:
        flat = broadcast_prefix(in_specs, dyn_args, is_leaf=is_leaf)
    except ValueError as e:  # jax's tree matching says why the structures differ
        return MeshError(
            "in_specs does not match the structure of the arguments (a PartitionSpec, "
            f"None or a pytree of them per argument): {e}"
        )
    g, mesh = problem.graph, problem.mesh
    if roll is not None:
        flat = rolled_specs(roll, flat, g, axis)
        if isinstance(flat, MeshError):
            return flat
    pins: dict[int, int] = {}
    for i, pspec in enumerate(flat):
        if pspec is None:
            continue
        t = g.values[g.inputs[i]]
        named = _named_axes(pspec)
        unknown = [a for a in named if a not in mesh.axis_names]
        if unknown or len(pspec) > t.rank:
            return MeshError(
                f"in_specs for {g.input_paths[i]} {t}: {pspec} "
                + (
                    f"names axes {unknown} that the mesh {mesh.shape} does not have"
                    + did_you_mean(unknown[0], mesh.axis_names)
                    if unknown
                    else f"has more entries than the array has dims ({t.rank})"
                )
            )
        twice = sorted({a for a in named if named.count(a) > 1})
        if twice:
            return MeshError(
                f"in_specs for {g.input_paths[i]} {t}: {pspec} names mesh axis "
                f"{twice[0]!r} more than once; a mesh axis shards at most one dim, once"
            )
        spec = Spec.from_pspec(pspec, t.rank).without_trivial_axes(mesh)
        match = [k for k, s in enumerate(problem.strategies[i]) if s.out_specs[0] == spec]
        if not match:
            return MeshError(
                f"in_specs for {g.input_paths[i]}: {pspec} cannot shard shape {list(t.shape)} on mesh {mesh.shape} "
                "(each sharded dim must be divisible by the product of its axes' sizes). Pick axes that divide it, or None to let autopar decide."
            )
        pins[i] = match[0]
    return pins


def _named_axes(pspec) -> list[str]:
    """The mesh axes a PartitionSpec names, in order, repeats kept."""
    return [a for d in pspec if d for a in ((d,) if isinstance(d, str) else d)]


def rolled_specs(roll: Roll, flat: list, graph: Graph, axis: str) -> list | MeshError:
    """The user's spec per flat leaf as one per rolled input: a leaf's own, or for a
    group (one leaf of the same slot per stage, `passes.roll`) its layers' one spec
    with dim 0 split over the stage axis (`axis`) first, so that each stage holds its layer's
    leaf laid out as given (`lower.rolled.member_spec` is the inverse)."""
    from jax.sharding import PartitionSpec

    out: list = []
    for i, (ms, stacked) in enumerate(zip(roll.inputs, roll.stacked_in)):
        if len(ms) == 1:
            out.append(flat[ms[0]])
            continue
        given = {flat[m] for m in ms}
        path = graph.input_paths[i]
        if len(given) > 1:
            return MeshError(
                f"in_specs for the leaves of {path} (one per layer of a stack unrolled in "
                f"Python, rolled into a pipeline): {sorted(map(str, given))} differ; the "
                "layers of a pipelined stack share one layout (give every layer's leaf the "
                "same spec, or None to let autopar decide)"
            )
        (pspec,) = given
        if pspec is None:
            out.append(None)
            continue
        named = _named_axes(pspec)
        if axis in named:
            return MeshError(
                f"in_specs for the leaves of {path}: {pspec} names the {axis!r} axis, "
                "which the pipeline splits the layers over; leave it out of a layer's spec"
            )
        if stacked:  # a group of scalars: one row per stage
            out.append(PartitionSpec(axis))
            continue
        first = pspec[0] if len(pspec) else None
        head = (first,) if isinstance(first, str) else tuple(first or ())
        out.append(PartitionSpec((axis, *head), *pspec[1:]))
    return out


def reusable_specs(plan: Plan, graph: Graph, mesh: MeshInfo) -> dict[int, Spec]:
    """Input position -> the saved spec, for inputs of `graph` that `plan` also has with
    the same path, shape and dtype, and whose spec the mesh can still apply."""
    saved = {r.path: r for r in plan.inputs}
    out: dict[int, Spec] = {}
    for i, (path, v) in enumerate(zip(graph.input_paths, graph.inputs)):
        r, t = saved.get(path), graph.values[v]
        if r is None or (tuple(r.shape), r.dtype) != (t.shape, t.dtype_name):
            continue
        if all(a in mesh.axis_names for a in r.spec.used_axes):
            out[i] = r.spec.without_trivial_axes(mesh)
    return out


def spec_pins(problem: Problem, specs: dict[int, Spec]) -> dict[int, int]:
    """Pins for the input specs the problem's strategies can apply (the others are
    searched)."""
    pins = {}
    for i, spec in specs.items():
        match = [k for k, s in enumerate(problem.strategies[i]) if s.out_specs[0] == spec]
        if match:
            pins[i] = match[0]
    return pins


def _stage_layers(node, pipelined: PipelinedScans) -> list[tuple[int, int]]:
    """The layers each stage runs: the loop's steps, or, for a stack unrolled in Python
    and rolled (one step per stage), the stack's layers; interleaved, each virtual
    stage's (virtual stage `u` on stage `u mod S`)."""
    pipe = pipelined.pipe
    n = pipe.stages * pipe.virtual  # stages, or virtual stages
    if pipelined.roll is not None:  # one loop step per (virtual) stage
        k = pipelined.roll.layers // n
    elif pipe.virtual > 1:
        k = node.params["length"] // n
    else:
        return layer_ranges(node, pipe)
    return [(u * k, (u + 1) * k) for u in range(n)]


def make_plan(
    problem: Problem,
    result,
    profile,
    jax_mesh,
    pipelined: PipelinedScans | None = None,
    user: Graph | None = None,
) -> Plan:
    """The plan of `result` on `problem`; `user`: the function as traced where the
    problem's graph is its unrolled layers rolled into a pipeline (`pipelined.roll`),
    whose leaves `Plan.user_inputs` then describe."""
    g = problem.graph
    inputs, outputs, ops = _records(problem, result.choice, top=True)
    pipeline, leaves, results = None, None, None
    if pipelined is not None and pipelined.roll is not None and user is not None:
        leaves = user_leaves(pipelined.roll, inputs, user, pipelined.pipe.axis)
        results = user_leaves(pipelined.roll, outputs, user, pipelined.pipe.axis, outputs=True)
    if pipelined is not None:
        keys = op_keys(g)
        # each op's priced seconds under the chosen strategy (the schedule's slot times)
        n_in = problem.num_inputs
        priced = lambda i: float(problem.node_time[n_in + i][result.choice[n_in + i]])  # noqa: E731
        pipeline = {
            **pipelined.pipe.to_json(),
            "scans": [
                {
                    "op": keys[i],
                    "stages": [list(r) for r in _stage_layers(g.nodes[i], pipelined)],
                    "reverse": bool(g.nodes[i].params["reverse"]),
                    "seconds": priced(i),
                }
                for i in pipelined.scans
            ],
        }
        if pipelined.roll is not None:  # a stack unrolled in Python, rolled into loops
            pipeline["rolled"] = pipelined.roll.to_json()
        if pipelined.fused:
            pipeline["fused"] = [
                {
                    "forward": keys[f.forward],
                    "backward": keys[f.backward],
                    "head": [keys[h] for h in f.head],
                    "head_seconds": sum(priced(h) for h in f.head),
                    **(
                        {"weight_seconds": weight_slot_seconds(problem, pipelined, f, result)}
                        if pipelined.pipe.schedule == "zb-h1"
                        else {}
                    ),
                    **(
                        dict(
                            zip(
                                ("moved_seconds", "moved_bytes"),
                                moved_cost(problem, pipelined, f, result),
                            )
                        )
                        if pipelined.pipe.virtual > 1
                        else {}
                    ),
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
        search_info={**result.solver_info, "matmul_rates": matmul_rates(g, profile)},
        function=g.name,
        in_tree=g.in_tree if leaves is None else user.in_tree,
        out_tree=g.out_tree if results is None else user.out_tree,
        jax_mesh=jax_mesh,
        pipeline=pipeline,
        user_inputs=leaves,
        user_outputs=results,
    )


def user_leaves(
    roll: Roll, records: tuple, user: Graph, axis: str, outputs: bool = False
) -> tuple[TensorRecord, ...]:
    """The user's leaves (`outputs`: results) as a rolled program's `records` hold them:
    a leaf as it is, a group's member on its stage's sub-mesh (`lower.rolled.member_spec`;
    replicated there where the group is not split stage-major, as `lower.rolled.RolledIO`
    hands it back)."""
    values, paths = (
        (user.outputs, user.output_paths) if outputs else (user.inputs, user.input_paths)
    )
    groups = (roll.outputs, roll.stacked_out) if outputs else (roll.inputs, roll.stacked_in)
    out: list = [None] * len(values)
    for r, ms, stacked in zip(records, *groups):
        for s, m in enumerate(ms):
            t = user.values[values[m]]
            rec = TensorRecord(paths[m], t.shape, t.dtype_name, r.spec)
            if len(ms) > 1:
                member = member_spec(r.spec.to_pspec(), axis, stacked)
                spec = (
                    Spec.replicated(t.rank) if member is None else Spec.from_pspec(member, t.rank)
                )
                rec = replace(rec, spec=spec, stage=s)
            out[m] = rec
    return tuple(out)


def _records(problem: Problem, choice, top: bool = False) -> tuple[tuple, tuple, tuple]:
    """(inputs, outputs, ops) records of a choice; a scan op carries its body's, a
    cond its branches'; `top`: the step's own ops carry the layer the search put them
    in where their names say none (`op_layer_names`)."""
    g, n_in = problem.graph, problem.num_inputs
    layers = op_layer_names(problem) if top else [""] * len(g.nodes)
    strat = lambda v: problem.strategies[v][choice[v]]
    inputs = tuple(
        TensorRecord(p, g.values[v].shape, g.values[v].dtype_name, strat(i).out_specs[0])
        for i, (p, v) in enumerate(zip(g.input_paths, g.inputs))
    )
    outputs = tuple(
        TensorRecord(p, g.values[v].shape, g.values[v].dtype_name, spec)
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
            n.library_source,
            layers[n.id],
        )
        for n in g.nodes
    )
    return inputs, outputs, ops


def plan_mismatch(plan: Plan, graph: Graph, mesh: MeshInfo) -> str | None:
    """Why a loaded plan does not fit the traced function on `mesh` (the message of
    the PlanError `bind_plan` raises), or None when it does."""
    problems = []
    reshaped = False  # the same function (by name) and arguments, called with new shapes
    if (plan.mesh.axis_names, plan.mesh.axis_sizes) != (mesh.axis_names, mesh.axis_sizes):
        problems.append(
            f"the plan is for mesh {plan.mesh.shape}, the function runs on {mesh.shape}"
        )
    if plan.fingerprint != fingerprint(graph):
        have = {r.path: (r.shape, r.dtype) for r in plan.inputs}
        want = {
            p: (graph.values[v].shape, graph.values[v].dtype_name)
            for p, v in zip(graph.input_paths, graph.inputs)
        }
        told = lambda t: "not there" if t is None else f"{t[1]}{list(t[0])}"  # noqa: E731
        diffs = [
            f"{p}: plan {told(have.get(p))} vs function {told(want.get(p))}"
            for p in dict.fromkeys([*have, *want])
            if have.get(p) != want.get(p)
        ]
        detail = (
            "; ".join(diffs[:5])
            if diffs
            else f"same arguments but a different computation ({len(plan.ops)} ops in the plan, {len(graph.nodes)} traced)"
        )
        reshaped = bool(diffs) and have.keys() == want.keys() and plan.function == graph.name
        what = "other argument shapes" if reshaped else "a different function"
        problems.append(f"the plan was made for {what}: {detail}")
    if not problems:
        return None
    fix = ". Search a new plan (omit plan=) for this function."
    if reshaped:
        fix = (
            ". A plan holds for the shapes it was made for (as `jax.jit` compiles for them): "
            "search a new plan (omit plan=), or pass allow_partial=True to keep the specs of "
            "the arguments that still match and search the rest."
        )
    return (
        f"plan for {plan.function or '?'} does not match {graph.name}: " + "; ".join(problems) + fix
    )


def bind_plan(plan: Plan, graph: Graph, mesh: MeshInfo, jax_mesh) -> Plan:
    """Check a loaded plan against the traced function and attach the pytrees."""
    mismatch = plan_mismatch(plan, graph, mesh)
    if mismatch is not None:
        raise PlanError(mismatch)
    return attach(plan, graph, jax_mesh)


def attach(plan: Plan, graph: Graph, jax_mesh, user: Graph | None = None) -> Plan:
    """`plan` with the traced function's pytrees and the mesh it runs on (checked
    against it by `plan_mismatch`); `user`: the function as traced where `graph` is
    its layers rolled into a pipeline (the pytrees `Plan.user_inputs`/`user_outputs`
    stand for)."""
    return Plan(
        **{
            **plan.__dict__,
            "in_tree": (user or graph).in_tree if plan.user_inputs else graph.in_tree,
            "out_tree": (user or graph).out_tree if plan.user_outputs else graph.out_tree,
            "jax_mesh": jax_mesh,
        }
    )


def mesh_for_plan(meshes: Sequence, plan: Plan):
    """The mesh of `meshes` a loaded plan was made for (else the first)."""
    for mesh in meshes:
        if (tuple(mesh.axis_names), tuple(mesh.axis_sizes)) == (
            plan.mesh.axis_names,
            plan.mesh.axis_sizes,
        ):
            return mesh
    return meshes[0]  # bind_plan reports the mismatch
