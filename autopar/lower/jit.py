"""jit lowering: re-run the graph op by op, pinning every value to the plan's spec
with `with_sharding_constraint`; XLA's partitioner inserts the collectives.

A sharding constraint cannot say "partial sum", so a partial value is summed where
it is produced (`settle_partials`) unless a linear op takes it as the same partial
sum. Such a value is kept *stacked*: a global array with one extra leading dim,
sharded over the partial axes, whose slices are the per-device summands; ops on
it run per device inside `shard_map`, and a sum over the leading dim (an
all-reduce or reduce-scatter) settles it where a use wants the true value.
Contractions (`EXACT_OPS`) always run per device in `shard_map`, on exactly the
operand shards the plan chose, so the compiled program communicates what the
plan priced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from autopar.ir.chunks import CHUNK_OPS
from autopar.ir.eval import bind_node, drawn_per_microbatch, run_nodes
from autopar.ir.graph import Graph, Node
from autopar.ir.ops import CONTRACTIONS
from autopar.lower.batching import taken, unbatched
from autopar.lower.pipeline import PipelinedLoop, run_1f1b, run_gpipe
from autopar.passes.accumulate import is_accumulation
from autopar.passes.interleave import resident
from autopar.passes.pipeline import Fused, PipelinedScans, sunk_fills
from autopar.passes.precision import upcast_operands
from autopar.passes.zero_bubble import WeightSplit, split_weight_grads
from autopar.plan.plan import Plan
from autopar.plan.records import BodyRecord, TensorRecord
from autopar.sharding import Spec
from autopar.strategies.linear import LOCAL_OPS
from autopar.strategies.settle import settle_partials

# Contractions run per device exactly as planned, in `shard_map`: left to XLA's
# partitioner, one may be split its own way (e.g. a GPT's output-embedding gradient
# all-gathered a 3.2 GB operand where the plan sums a 200 MB result).
EXACT_OPS = CONTRACTIONS


def interpret(
    graph: Graph,
    plan: Plan | BodyRecord,
    mesh,
    pin_inputs: bool = False,
    pipelined: PipelinedScans | None = None,
    index=None,
) -> Callable:
    """A function of the flat args that computes `graph` under `plan`'s shardings.
    `pin_inputs` constrains the args to their specs on entry (a scan body's, whose
    carry and slices come in however the loop left them). The scans in `pipelined`
    run as pipelines over its stage axis. `index`: the micro-batch a pipeline stage's
    body runs on, folded into its random draws' keys (`drawn_per_microbatch`).

    The loop is its own, not `autopar.ir.eval.evaluate`'s: an operand is read in the
    layout its node's path wants (per device as planned, or whole), a result is laid
    out as it is made, and a 1F1B region runs its nodes as one unit, out of the
    captured order. Each node binds through `bind` (`autopar.ir.eval.bind_node`)."""
    in_specs = {v: r.spec for v, r in zip(graph.inputs, plan.inputs)}
    settled = settle_partials(
        graph,
        [o.in_specs for o in plan.ops],
        [o.out_specs for o in plan.ops],
        [r.spec for r in plan.outputs],
    )

    def constrain(x, spec: Spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec.to_pspec()))

    # inside a pipeline's shard_map the stage axis is already manual
    manual = set(getattr(mesh, "manual_axes", ()))

    def smap(f, in_specs, out_specs):
        return jax.shard_map(
            f,
            mesh=mesh,
            in_specs=tuple(in_specs),
            out_specs=tuple(out_specs),
            axis_names={a for a in mesh.axis_names if a not in manual},
            check_vma=False,
        )

    def split(x, want: Spec):
        """A whole value as summands over `want.partial`: the first device keeps it."""

        def body(x):
            first = math.prod(jax.lax.axis_index(a) == 0 for a in want.partial)
            return (jnp.where(first, x, jnp.zeros_like(x))[None],)

        return smap(body, [want.to_pspec()], [want.stacked_pspec()])(x)[0]

    def run(*flat_args):
        if pin_inputs:
            flat_args = [
                jax.lax.with_sharding_constraint(
                    x, NamedSharding(mesh, in_specs[v].stacked_pspec())
                )
                if in_specs[v].partial
                else constrain(x, in_specs[v])
                if in_specs[v].dims
                else x
                for v, x in zip(graph.inputs, flat_args)
            ]
        env: dict[int, object] = dict(zip(graph.inputs, flat_args))
        # the spec env[v] is in: partial means stacked; None, a whole value XLA may
        # lay out as it likes (a result of the plain path, not yet constrained)
        produced: dict[int, Spec | None] = dict(in_specs)

        def read(v: int, want: Spec):
            if v in graph.consts:
                x, have = jnp.asarray(graph.consts[v]), None
            else:
                x, have = env[v], produced[v]
                if have == want:
                    return x
            dense = want.without_partial()
            summed = have is not None and have.partial
            if summed:
                x = jnp.sum(x, axis=0, dtype=x.dtype)
                # reduce-scattered as the cost model prices it (`Spec.summed_into`), then
                # moved as a dense value: told only `dense`, XLA may sum whole and then
                # send every block across the mesh (a collective-permute). Where no
                # axis is scattered, or the scatter reaches `dense`, XLA sums as it likes.
                scattered = have.summed_into(dense)
                then_moved = scattered.dims not in (have.dims, dense.dims)
                have = None
                if then_moved and _divides(x.shape, scattered, mesh):
                    x, have = constrain(x, scattered), scattered
            if have is not None:
                # one axis moved at a time, then the gather (`Spec.move_steps`)
                steps = have.move_steps(dense) or (have.gather_last(dense),)
                for mid in steps:
                    if mid not in (have, dense) and _divides(x.shape, mid, mesh):
                        x = constrain(x, mid)
            if dense.dims or summed:
                x = constrain(x, dense)
            return split(x, want) if want.partial else x

        def wants(node: Node) -> list[Spec]:
            return [
                settled.get(v, s.without_partial())
                for v, s in zip(node.outputs, plan.ops[node.id].out_specs)
            ]

        def store(node: Node, outs, haves) -> None:
            for v, val, have, want in zip(node.outputs, outs, haves, wants(node)):
                if val is None:  # a 1F1B loop's saved activations never leave it
                    continue
                env[v], produced[v] = val, have
                if have != want:
                    env[v], produced[v] = read(v, want), want

        sinks = sunk_fills(graph, pipelined) if pipelined is not None else {}
        # interleaved: the rolled groups' rows in chunk order, as the stages hold them
        interleaved = pipelined is not None and pipelined.pipe.virtual > 1
        kept = resident(graph, pipelined.fused) if interleaved else frozenset()
        zb_backward = {f.backward for f in pipelined.fused} if pipelined is not None else set()

        def loop_input(node: Node, i: int, spec: Spec):
            """Input `i` of a pipelined loop as it enters the pipeline: a sunk fill's
            batch-free operand (whole: the stage broadcasts it), else the input."""
            if i in sinks.get(node.id, {}):
                x = sinks[node.id][i].inputs[0]
                return read(x, Spec.replicated(graph.values[x].rank))
            return read(node.inputs[i], spec)

        def pipelined_loop(node: Node) -> PipelinedLoop:
            micro, labels = pipelined.scans[node.id]
            rec = plan.ops[node.id]
            # traced inside the pipeline's shard_map, on its partly manual mesh
            # (`index`: the micro-batch, folded into the body's random draws)
            run_body = lambda *xs, index: interpret(
                micro, rec.body, jax.sharding.get_abstract_mesh(), pin_inputs=True, index=index
            )(*xs)
            specs = [r.spec for r in rec.body.outputs]
            fills = {i: b.params["broadcast_dimensions"] for i, b in sinks.get(node.id, {}).items()}
            split, run_split = None, None
            if pipelined.pipe.schedule == "zb-h1" and node.id in zb_backward:
                p = node.params
                split = split_weight_grads(micro, p["num_consts"], p["num_carry"])
                if split is not None:
                    b_rec, w_rec = split_records(micro, rec.body, split, p["num_carry"])
                    run_split = tuple(
                        lambda *xs, index, g=g, r=r: interpret(
                            g, r, jax.sharding.get_abstract_mesh(), pin_inputs=True, index=index
                        )(*xs)
                        for g, r in ((split.b, b_rec), (split.w, w_rec))
                    )
            return PipelinedLoop(
                node, micro, labels, run_body, pipelined.pipe, mesh, specs, fills, split, run_split
            )

        def run_fused(fz: Fused) -> None:
            F, B = graph.nodes[fz.forward], graph.nodes[fz.backward]
            rec_f, rec_b = plan.ops[F.id], plan.ops[B.id]
            made = {v for h in fz.head for v in graph.nodes[h].outputs} | set(F.outputs)
            f_in = [loop_input(F, i, s) for i, s in enumerate(rec_f.in_specs)]
            b_in = {
                i: loop_input(B, i, s)
                for i, (v, s) in enumerate(zip(B.inputs, rec_b.in_specs))
                if v not in made
            }
            spec_of: dict[int, Spec] = {}
            for h in fz.head:
                for v, sp in zip(graph.nodes[h].inputs, plan.ops[h].in_specs):
                    spec_of.setdefault(v, sp.without_partial())
            h_in = [read(v, spec_of[v]) for v, _ in fz.head_ins if v not in F.outputs]
            members = fz.members()
            head_specs = {
                v: sp
                for h in fz.head
                for v, sp in zip(graph.nodes[h].outputs, wants(graph.nodes[h]))
            }
            keep = frozenset(
                v for n in graph.nodes if n.id not in members for v in n.inputs if v in F.outputs
            ) | frozenset(v for v in graph.outputs if v in F.outputs)
            f_outs, b_outs, heads = run_1f1b(
                fz,
                pipelined_loop(F),
                pipelined_loop(B),
                lambda env, index: _run_head(fz, env, head_specs, index),
                mesh,
                f_in,
                b_in,
                h_in,
                keep,
                kept,
            )
            store(F, f_outs, rec_f.out_specs)
            store(B, b_outs, rec_b.out_specs)
            for h in fz.head:
                node = graph.nodes[h]
                if any(v in heads for v in node.outputs):
                    outs = [heads.get(v) for v in node.outputs]
                    store(node, outs, [None] * len(outs))

        fused = {f.forward: f for f in pipelined.fused} if pipelined is not None else {}
        absorbed: set[int] = set()  # casts already run in their contraction's shard_map
        for node in _order(graph, fused.values()):
            if node.id in absorbed:
                continue
            rec = plan.ops[node.id]
            empty = any(graph.values[v].size == 0 for v in (*node.inputs, *node.outputs))
            local = (
                node.op in LOCAL_OPS
                and not empty
                and (
                    node.op in EXACT_OPS
                    or any(s.partial for s in rec.in_specs)
                    or any(w.partial for w in wants(node))
                )
            )
            if node.id in fused:
                run_fused(fused[node.id])
                continue
            if node.op in CHUNK_OPS and (node.inputs[0] in kept or node.outputs[0] in kept):
                # a pipeline's rows, in the order its stages keep them (`ir.chunks`)
                store(node, [read(node.inputs[0], rec.in_specs[0])], rec.out_specs)
                continue
            if not local and not empty and _summand_scatter(node, rec):
                # per device, as planned; the operand joins as the first device's summand
                rec = replace(rec, in_specs=(_with_partial(rec), *rec.in_specs[1:]))
                local = True
            if pipelined is not None and node.id in pipelined.scans:
                invals = [loop_input(node, i, s) for i, s in enumerate(rec.in_specs)]
                outs = run_gpipe(pipelined_loop(node), mesh, invals)
                haves = rec.out_specs
            elif node.body is not None:
                invals = [read(v, s) for v, s in zip(node.inputs, rec.in_specs)]
                outs, haves = _run_scan(node, rec, mesh, invals, index), rec.out_specs
            elif node.branches is not None and rec.branches is not None:
                invals = [read(v, s) for v, s in zip(node.inputs, rec.in_specs)]
                outs, haves = _run_cond(node, rec, mesh, invals, index), rec.out_specs
            elif local:
                invals = [read(v, s) for v, s in zip(node.inputs, rec.in_specs)]
                invals = drawn_per_microbatch(node, invals, index)
                exact = node.op in EXACT_OPS and not fused
                casts = _casts_of(node, rec, graph, plan, wants) if exact else []
                outs = _run_local(node, rec, graph, mesh, smap, invals, casts)
                outs, cast_outs = outs[: len(node.outputs)], outs[len(node.outputs) :]
                for c, val in zip(casts, cast_outs):
                    store(c, [val], plan.ops[c.id].out_specs)
                    absorbed.add(c.id)
                haves = rec.out_specs
            else:
                invals = [read(v, s.without_partial()) for v, s in zip(node.inputs, rec.in_specs)]
                invals = drawn_per_microbatch(node, invals, index)
                outs, haves = bind(node, invals, manual=bool(manual)), [None] * len(node.outputs)
            store(node, outs, haves)
        return tuple(read(v, r.spec) for v, r in zip(graph.outputs, plan.outputs))

    return run


# Scatters that add: updates split along their scattered dims leave each device a
# summand of the result, the Partial sum the plan prices (scatter_rule).
ADDING_SCATTERS = frozenset({"scatter-add", "scatter_add"})


def _summand_scatter(node: Node, rec) -> bool:
    """Whether `node` is a scatter-add planned to leave a Partial sum that runs per
    device: left to XLA's partitioner, it sums the result at once (an all-reduce the
    plan does not have, e.g. a GPT's 200 MB embedding gradient summed twice, before
    and after adding the output projection's). Not where the operand's indexed dims
    are split: per-device indices would need offsetting."""
    if node.op not in ADDING_SCATTERS or not rec.out_specs[0].partial:
        return False
    if len(node.inputs) != 3 or rec.in_specs[0].partial:
        return False
    dn = node.params["dimension_numbers"]
    return not any(rec.in_specs[0].dims[d] for d in dn.scatter_dims_to_operand_dims)


def _with_partial(rec) -> Spec:
    """The operand's spec as a summand over the result's Partial axes: each device
    adds its updates to its summand, so the sum over devices adds the operand once."""
    return Spec(rec.in_specs[0].dims, rec.out_specs[0].partial)


def split_records(
    body: Graph, rec: BodyRecord, split: WeightSplit, num_carry: int
) -> tuple[BodyRecord, BodyRecord]:
    """The body plan `rec` as the plans of the split's `B` and `W` graphs: each op as
    planned; a boundary value leaves `B` and enters `W` in the layout it is made in
    (settled, and summed where it is a partial sum), so passing it on moves nothing."""
    settled = settle_partials(
        body,
        [o.in_specs for o in rec.ops],
        [o.out_specs for o in rec.ops],
        [r.spec for r in rec.outputs],
    )
    made = {v: sp for n, o in zip(body.nodes, rec.ops) for v, sp in zip(n.outputs, o.out_specs)}
    given = dict(zip(body.inputs, rec.inputs))
    bnd = []
    for v in split.boundary:
        if v in given:
            bnd.append(replace(given[v], path=f"boundary/{v}"))
        else:
            t = body.values[v]
            # a partial sum is summed before it leaves `B` (the buffer holds whole
            # values; `W` takes a summand back where an op of it reads one)
            spec = settled.get(v, made[v]).without_partial()
            bnd.append(TensorRecord(f"boundary/{v}", t.shape, t.dtype_name, spec))
    b = replace(
        rec,
        outputs=(*rec.outputs[:num_carry], *bnd),
        ops=tuple(rec.ops[n] for n in split.b_nodes),
    )
    w = replace(
        rec,
        inputs=(*(rec.inputs[i] for i in split.w_inputs), *bnd),
        outputs=rec.outputs[num_carry:],
        ops=tuple(rec.ops[n] for n in split.w_nodes),
    )
    return b, w


def _order(graph: Graph, fused) -> list[Node]:
    """The nodes in the order the interpreter runs them: a 1F1B region runs as one
    unit where its forward loop is, after everything it reads (some of which may come
    later in the captured order); its head and backward loop are not run again."""
    order = list(graph.nodes)
    producer = graph.producer
    for fz in fused:
        members = fz.members()
        # what the region reads from ops the capture placed after its forward loop
        hoist: set[int] = set()
        todo = [
            producer[v]
            for m in members
            for v in graph.nodes[m].inputs
            if producer.get(v, -1) > fz.forward and producer[v] not in members
        ]
        while todo:
            n = todo.pop()
            if n not in hoist:
                hoist.add(n)
                todo += [
                    producer[v] for v in graph.nodes[n].inputs if producer.get(v, -1) > fz.forward
                ]
        order = (
            [n for n in order if n.id < fz.forward and n.id not in members or n.id in hoist]
            + [graph.nodes[fz.forward]]
            + [n for n in order if n.id > fz.forward and n.id not in members | hoist]
        )
    return order


def _run_head(fz: Fused, env: dict, specs: dict[int, Spec], index) -> dict:
    """The head's ops on micro-batch `index`'s values (folded into its random draws'
    keys), each result laid out as the plan has it (the plan's specs are free of the
    stage axis) where its dims divide."""
    mesh = jax.sharding.get_abstract_mesh()
    env = dict(env)
    manual = set(getattr(mesh, "manual_axes", ()))

    def laid_out(n: Node, ins: list) -> list:
        outs = bind(n, drawn_per_microbatch(n, ins, index), manual=True)
        for i, (v, x) in enumerate(zip(n.outputs, outs)):
            sp = specs.get(v)
            if sp is not None and manual & set(sp.used_axes):  # a value the step's ops
                # after the pipeline read split over the stage axis too: not in here
                sp = Spec(tuple(tuple(a for a in d if a not in manual) for d in sp.dims))
            if sp is not None and sp.dims and _divides(x.shape, sp, mesh):
                outs[i] = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, sp.to_pspec()))
        return outs

    read = lambda v: env[v] if v in env else jnp.asarray(fz.micro_consts[v])
    return run_nodes(fz.micro_nodes, read, env, laid_out)


def _divides(shape, spec: Spec, mesh) -> bool:
    return all(n % math.prod(mesh.shape[a] for a in axes) == 0 for n, axes in zip(shape, spec.dims))


def _run_scan(node: Node, rec, mesh, invals, index=None) -> list:
    """`lax.scan` over the body interpreted under its own plan (`rec.body`)."""
    p = node.params
    n_c, n_carry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:n_c], invals[n_c : n_c + n_carry], invals[n_c + n_carry :]
    run_body = interpret(node.body, rec.body, mesh, pin_inputs=True, index=index)
    # A gradient accumulation loop whose body reads weights split (ZeRO-3) gathers them
    # each micro-batch; XLA would hoist those gathers out of the loop (a whole copy of
    # every weight alive through it, what ZeRO-3 is chosen to avoid), so the split
    # weights go through a barrier with the carry: values of the step, not invariants.
    split = [i for i in range(n_c) if rec.body.inputs[i].spec.used_axes]
    if not is_accumulation(node) or not n_carry:
        split = []

    def step(carry, x):
        ws = list(consts)
        if split:
            held, carry = jax.lax.optimization_barrier(([ws[i] for i in split], carry))
            for i, w in zip(split, held):
                ws[i] = w
        outs = run_body(*ws, *carry, *x)
        return list(outs[:n_carry]), list(outs[n_carry:])

    carry, ys = jax.lax.scan(
        step, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


def _run_cond(node: Node, rec, mesh, invals, index=None) -> list:
    """`lax.switch` over the branches, each interpreted under its own plan
    (`rec.branches`: the cond's operand specs in, its result specs out)."""
    runs = [
        interpret(b, r, mesh, pin_inputs=True, index=index)
        for b, r in zip(node.branches, rec.branches)
    ]
    return list(
        jax.lax.switch(invals[0], [lambda *xs, f=f: list(f(*xs)) for f in runs], *invals[1:])
    )


def _casts_of(node: Node, rec, graph: Graph, plan, wants) -> list[Node]:
    """The float casts of a contraction's result planned in the layout it comes out in
    (e.g. a batch norm's f32 upcast of a bf16 convolution): they run per device in the
    contraction's `shard_map`. Outside it, the boundary's copies sit between the result
    and the cast, and XLA:CPU, which computes bf16 convolutions in f32, then keeps the
    f32 -> bf16 -> f32 round trip (two more passes over the activation) that it drops
    when the cast reads the convolution directly, as in a plain `jax.jit` program."""
    if len(node.outputs) != 1 or rec.out_specs[0].partial:
        return []
    v, have = node.outputs[0], rec.out_specs[0]
    casts = []
    for c in graph.consumers.get(v, ()):
        c = graph.nodes[c]
        crec = plan.ops[c.id]
        if (
            c.op == "convert_element_type"
            and crec.in_specs[0] == have
            and crec.out_specs[0] == have
            and wants(c)[0] == have
            and graph.values[c.outputs[0]].size
        ):
            casts.append(c)
    return casts


def _run_local(node: Node, rec, graph: Graph, mesh, smap, invals, casts=()) -> list:
    """Run `node` per device on its shards; partial operands and results are stacked.
    The `casts` of its (unstacked) first result run on the same shards; their results
    follow `node`'s."""
    local_shapes = [
        tuple(s // math.prod(mesh.shape[a] for a in d) for s, d in zip(t.shape, sp.dims))
        for t, sp in zip((graph.values[v] for v in node.outputs), rec.out_specs)
    ]

    node = _local_groups(node, rec, mesh)

    def body(*xs):
        xs = [x[0] if s.partial else x for x, s in zip(xs, rec.in_specs)]
        outs = bind(node, xs, local_shapes[0])
        cast = [bind(c, [outs[0]], local_shapes[0])[0] for c in casts]
        return (*(o[None] if s.partial else o for o, s in zip(outs, rec.out_specs)), *cast)

    ins = [s.stacked_pspec() if s.partial else s.to_pspec() for s in rec.in_specs]
    outs = [s.stacked_pspec() if s.partial else s.to_pspec() for s in rec.out_specs]
    outs += [rec.out_specs[0].to_pspec()] * len(casts)
    return list(smap(body, ins, outs)(*invals))


def _local_groups(node: Node, rec, mesh) -> Node:
    """A grouped convolution as one device runs it: its groups split `k` ways (the lhs
    dim that holds them, sharded over `k` devices; `strategies.linalg.conv_rule`) leave
    each device `1/k` of them."""
    if node.op != "conv_general_dilated":
        return node
    lhs_spec = node.params["dimension_numbers"].lhs_spec
    params = dict(node.params)
    for key, dim in (("feature_group_count", lhs_spec[1]), ("batch_group_count", lhs_spec[0])):
        k = math.prod(mesh.shape[a] for a in rec.in_specs[0].dims[dim])
        if params[key] > 1 and k > 1:
            params[key] //= k
    return replace(node, params=params)


def bind(node, invals, local_shape: tuple[int, ...] | None = None, manual: bool = False) -> list:
    """Apply a captured node's primitive (`autopar.ir.eval.bind_node`: its results as a
    list); inside `shard_map`, shape parameters are the per-device `local_shape` (or, in
    a `manual` region whose values keep their global shape, only the traced shardings
    go)."""
    params = dict(node.params)
    if local_shape is not None or manual:
        # Shardings traced under the user's mesh name global layouts; per device there
        # are none.
        for k in ("sharding", "out_sharding"):
            if k in params:
                params[k] = None
    if local_shape is not None and node.op == "broadcast_in_dim":
        params["shape"] = local_shape
    elif local_shape is not None and node.op == "reshape":
        params["new_sizes"] = local_shape
    if manual:  # XLA:CPU aborts on batching dims there (`lower.batching`)
        if (values := taken(node, invals, params)) is not None:
            return values
        if (rewritten := unbatched(node, invals, params)) is not None:
            invals, params = rewritten
    if jax.default_backend() == "cpu":  # no bf16 x bf16 = f32 dot kernel there
        invals = upcast_operands(node, invals)
    return bind_node(node, invals, params)


def jit_from_plan(
    graph: Graph,
    plan: Plan,
    mesh,
    donate: Sequence[int] = (),
    pipelined: PipelinedScans | None = None,
):
    """`jax.jit` of the interpreted graph with the plan's in/out shardings."""
    shard = lambda recs: tuple(NamedSharding(mesh, r.spec.to_pspec()) for r in recs)
    return jax.jit(
        interpret(graph, plan, mesh, pipelined=pipelined),
        in_shardings=shard(plan.inputs),
        out_shardings=shard(plan.outputs),
        donate_argnums=tuple(donate),
    )
