"""What pipelining adds to the price of a step (`search.build`): the time of each
pipelined loop (less, under ZB-H1, the weight gradients taken off the ramp up), the
alternating 1F1B schedule's waits, and the fraction of the values a 1F1B pipeline
holds at once. The schedules are `autopar.lower.pipeline`'s."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from autopar.cost.model import CostModel
from autopar.ir.graph import Graph, Node
from autopar.passes.interleave import chunk_permutes, interleaved_slots, resident
from autopar.passes.pipeline import (
    SAME,
    SUM,
    Pipeline,
    PipelinedScans,
    chunk_layers,
    stage_layers,
    sunk_fills,
)
from autopar.passes.zero_bubble import WeightSplit, split_weight_grads
from autopar.search.result import SearchResult

Problem = Any  # a loop body's `search.build.Problem` (which imports this module)


def loop_times(
    graph: Graph, pipelined: PipelinedScans, bodies: dict, cost: CostModel
) -> tuple[dict[int, np.ndarray], dict[int, tuple[tuple[float, dict[str, int]], ...]]]:
    """Each pipelined loop's time by strategy (`bodies`: node id -> (its body's
    problem, one body result per strategy), `Problem.bodies`), and the communication
    in it (`Problem.loop_comm`; `_pipeline_comm`): `M + S - 1` slots (`M v + S - 1`
    chunk slots, interleaved) of one micro-batch through one stage's layers (one
    chunk's) and a hop of its carry to the next stage, then (outside a 1F1B region) the
    final carry, which only the last stage holds, all-reduced over the stage axis; the
    interleaved schedule's moves; ZB-H1's deferred weight gradients. GPipe and
    lock-step 1F1B alike: 1F1B runs a forward and a backward slot per tick, with ramps
    of forward-only and backward-only slots (the alternating 1F1B adds
    `alternating_waits`)."""
    inside = _inside_1f1b(graph, pipelined)
    pipe = pipelined.pipe
    times, comms = {}, {}
    for i in pipelined.scans:
        if i not in bodies:
            continue
        node, body = graph.nodes[i], bodies[i][0]
        split = _deferred_split(graph, pipelined, i, body)
        moved = _moved(graph, pipelined, i)
        comms[i] = tuple(
            _pipeline_comm(node, body, pipe, cost, r, i not in inside, moved) for r in bodies[i][1]
        )
        on_stage = pipe.ticks() * chunk_layers(node, pipe)
        times[i] = np.array(
            [
                on_stage * r.cost.compute_s + comm + _deferral_seconds(node, body, pipe, r, split)
                for r, (comm, _) in zip(bodies[i][1], comms[i])
            ]
        )
    return times, comms


def _pipeline_comm(
    node: Node, body: Problem, pipe: Pipeline, cost: CostModel, result, collect: bool, moved
) -> tuple[float, dict[str, int]]:
    """The communication of a pipelined loop (`loop_times`) under one body plan:
    seconds, and bytes per device by "kind@axes" (the layers' own every slot)."""
    ticks, layers = pipe.ticks(), chunk_layers(node, pipe)
    hop = _hop(node, body, pipe, cost, result)
    sent = [(hop, ticks)]
    if collect:  # the last stage's outputs reach every stage: all micro-batches' carry
        carry = hop.bytes * pipe.microbatches
        sent.append((cost.collective("all-reduce", (pipe.axis,), carry), 1))
    sent += _moves(pipe, cost, _moved_bytes(node, body, pipe, result, moved))
    by = {k: ticks * layers * b for k, b in result.cost.comm_bytes.items()}
    for c, times in sent:
        key = f"{c.kind}@{pipe.axis}"
        by[key] = by.get(key, 0) + times * c.bytes
    seconds = ticks * layers * result.cost.comm_s + sum(times * c.seconds for c, times in sent)
    return seconds, by


def _moved(graph: Graph, pipelined: PipelinedScans, i: int) -> tuple[list, list]:
    """Under the interleaved schedule, the per-layer inputs and outputs of fused loop
    `i` that the lowering moves between layer order and chunk order
    (`autopar.lower.interleave`): (body input positions, body output positions), each
    with the micro-batches a row holds (1, or `M` for a batched value). Those from
    outside the 1F1B region only (the saved activations stay in chunk order); a value
    both loops read is moved once, for the forward loop."""
    fused = [f for f in pipelined.fused if i in (f.forward, f.backward)]
    if pipelined.pipe.virtual == 1 or not fused:
        return [], []
    node, labels = graph.nodes[i], pipelined.scans[i][1]
    M = pipelined.pipe.microbatches
    per = lambda lab: 1 if lab in (SUM, SAME) else M  # noqa: E731
    first = node.params["num_consts"] + node.params["num_carry"]
    F = graph.nodes[fused[0].forward]
    read = set(resident(graph, fused))  # a rolled stack's groups, stored in chunk order
    if i != F.id:  # what the forward loop moves already, or the region makes
        read |= set(F.inputs) | set(F.outputs)
        read |= {v for h in fused[0].head for v in graph.nodes[h].outputs}
    ins = [
        (j, per(labels.ins[j]))
        for j in range(first, len(node.inputs))
        if node.inputs[j] not in read
    ]
    if i == fused[0].forward:
        return ins, []
    n_k = node.params["num_carry"]
    outs = range(n_k, len(node.outputs))
    return ins, [(j, per(labels.outs[j])) for j in outs if node.outputs[j] not in read]


def _moves(pipe: Pipeline, cost: CostModel, moved_bytes: list) -> list:
    """The collective-permutes that move the values of `moved_bytes` (`_moved_bytes`)
    into chunk order and back, each with how many times a step sends it: per value,
    one permute of a chunk's rows per `chunk_permutes`."""
    permutes = chunk_permutes(pipe.stages, pipe.virtual)
    return [
        (cost.collective("collective-permute", (pipe.axis,), b / pipe.virtual), permutes)
        for b in moved_bytes
    ]


def _moved_bytes(node: Node, body: Problem, pipe: Pipeline, result: SearchResult, moved) -> list:
    """Each device's bytes of every value `_moved` names: a stage's rows of it, in the
    layouts `result` makes them."""
    ins, outs = moved
    g, k = body.graph, stage_layers(node, pipe)
    return [k * per * _value_bytes(body, result, g.inputs[j]) for j, per in ins] + [
        k * per * _value_bytes(body, result, g.outputs[j]) for j, per in outs
    ]


def _value_bytes(body: Problem, result: SearchResult, v: int) -> int:
    """Each device's bytes of body value `v` for one micro-batch in one layer, in the
    layout `result` makes it (summed where partial, as the lowering keeps it)."""
    c, q = body.source[v]
    spec = body.strategies[c][result.choice[c]].out_specs[q].without_partial()
    return body.cost.local_bytes(body.graph.values[v], spec)


def rescheduled(problem: Problem, pipelined: PipelinedScans) -> Problem:
    """`problem` (built with a pipeline) priced under `pipelined`'s schedule instead:
    the same strategies, nested plans and edges; each pipelined loop's time and the
    pipeline's buffers as `pipelined` runs them. Between lock-step 1F1B and ZB-H1,
    which run the same loop bodies and hold the same values, that is all that
    changes."""
    g, n_in = problem.graph, problem.num_inputs
    times, comms = loop_times(g, pipelined, problem.bodies, problem.cost)
    buffers = pipeline_buffers(g, pipelined, problem.bodies)
    node_time = list(problem.node_time)
    node_compute = list(problem.compute_time())
    node_mem = list(problem.node_mem)
    for i, t in times.items():  # a loop's whole price; `loop_comm` says what is communication
        node_time[n_in + i] = node_compute[n_in + i] = t
    for i in problem.buffers.keys() | buffers.keys():
        node_mem[n_in + i] = node_mem[n_in + i] - problem.buffers.get(i, 0.0) + buffers.get(i, 0.0)
    return replace(
        problem,
        node_time=tuple(node_time),
        node_compute=tuple(node_compute),
        node_mem=tuple(node_mem),
        buffers=buffers,
        loop_comm={**problem.loop_comm, **comms},
    )


def _deferral_seconds(
    node: Node, body: Problem, pipe: Pipeline, result: SearchResult, split: WeightSplit | None
) -> float:
    """What ZB-H1 changes in its backward loop's `M + S - 1` lock-step slots: the `S - 1`
    slots of the ramp up run no weight gradients (less `S - 1` times `W`'s own ops),
    and the `M` weight-gradient passes also make again what they recompute
    (`WeightSplit.recomputed`, run in `B` too)."""
    if split is None:
        return 0.0
    w_only, redo = weight_grad_seconds(node, body, pipe, result, split)
    return -(pipe.stages - 1) * w_only + pipe.microbatches * redo


def _deferred_split(graph: Graph, pipelined: PipelinedScans, i: int, body: Problem):
    """The weight-gradient split of pipelined loop `i`'s body where ZB-H1 defers it."""
    if pipelined.pipe.schedule != "zb-h1" or i not in {f.backward for f in pipelined.fused}:
        return None
    node = graph.nodes[i]
    return split_weight_grads(body.graph, node.params["num_consts"], node.params["num_carry"])


def pipeline_buffers(graph: Graph, pipelined: PipelinedScans, bodies: dict) -> dict:
    """`Problem.buffers`, by loop strategy: under ZB-H1, each backward loop's ring of
    boundary values (`WeightSplit.boundary`: what a micro-batch's weight gradients read
    from its input gradient), `min(M, S)` micro-batches of one stage's layers, and
    where a stage runs more than one layer a loop (`_stage_loop_copies`), one more
    micro-batch of them and a copy of the saved activations the weight-gradient loop
    reads (made from their slot while the input-gradient loop holds its own; measured
    on XLA:CPU, 2 stages of 2 and 4 layers: compiled 1.24x and 1.26x the prediction
    without these, 1.03x with); under the interleaved schedule, each fused loop's values in
    chunk order (`_moved`: a second copy of its stage's weights, and of their
    gradients)."""
    out = {}
    pipe = pipelined.pipe
    for i in pipelined.scans:
        if i not in bodies:
            continue
        body, node = bodies[i][0], graph.nodes[i]
        split = _deferred_split(graph, pipelined, i, body)
        moved = _moved(graph, pipelined, i)
        if split is None and not any(moved):
            continue
        k = stage_layers(node, pipe)
        slots = (min(pipe.microbatches, pipe.stages) + (k > 1)) * k
        out[i] = np.array(
            [
                (_zb_bytes(node, body, split, r, slots, k) if split is not None else 0.0)
                + sum(_moved_bytes(node, body, pipe, r, moved))
                for r in bodies[i][1]
            ],
            dtype=np.float64,
        )
    return out


def _zb_bytes(
    node: Node, body: Problem, split: WeightSplit, result: SearchResult, slots: int, k: int
) -> float:
    """A ZB-H1 backward loop's buffers under `result` (`pipeline_buffers`): `slots`
    layers' boundary values and, for `k` > 1 layers a stage, `k` layers' copy of the
    loop inputs (`xs`) the weight gradients read."""
    xs = node.params["num_consts"] + node.params["num_carry"]
    read = [body.graph.inputs[p] for p in split.w_inputs if p >= xs] if k > 1 else []
    return slots * sum(_value_bytes(body, result, v) for v in split.boundary) + k * sum(
        _value_bytes(body, result, v) for v in read
    )


def weight_slot_seconds(problem, pipelined: PipelinedScans, fused, result) -> float:
    """One ZB-H1 weight-gradient slot of `fused`'s backward loop under the plan
    `result` of the outer `problem` (`weight_grad_seconds`, both parts; 0 where
    nothing is deferred)."""
    i = fused.backward
    if i not in problem.bodies:
        return 0.0
    body, results = problem.bodies[i]
    node = problem.graph.nodes[i]
    r = results[result.choice[problem.num_inputs + i]]
    split = _deferred_split(problem.graph, pipelined, i, body)
    return sum(weight_grad_seconds(node, body, pipelined.pipe, r, split))


def moved_cost(problem, pipelined: PipelinedScans, fused, result) -> tuple[float, float]:
    """What the interleaved schedule's moves into chunk order and back cost `fused`'s
    two loops under the plan `result` of the outer `problem` (`_moved`): (seconds,
    bytes held per device); zeros for the other schedules."""
    seconds = held = 0.0
    for i in (fused.forward, fused.backward):
        if i not in problem.bodies:
            continue
        body, results = problem.bodies[i]
        node = problem.graph.nodes[i]
        r = results[result.choice[problem.num_inputs + i]]
        moved = _moved_bytes(node, body, pipelined.pipe, r, _moved(problem.graph, pipelined, i))
        seconds += sum(n * c.seconds for c, n in _moves(pipelined.pipe, problem.cost, moved))
        held += sum(moved)
    return seconds, held


def weight_grad_seconds(
    node: Node, body: Problem, pipe: Pipeline, result: SearchResult, split: WeightSplit | None
) -> tuple[float, float]:
    """The weight-gradient pass (`WeightSplit.w`) of one stage's layers for one
    micro-batch, as the ops' own times under the body's plan: (the ops only `W` runs,
    those it makes again that `B` runs too); zeros without a split. The reshards
    between them are left on the backward slot (the saving is not overstated)."""
    if split is None:
        return 0.0, 0.0
    n_in, redo = body.num_inputs, set(split.recomputed)
    t = [float(body.node_time[n_in + j][result.choice[n_in + j]]) for j in split.w_nodes]
    k = stage_layers(node, pipe)
    again = sum(x for j, x in zip(split.w_nodes, t) if j in redo)
    return k * (sum(t) - again), k * again


def alternating_waits(
    graph: Graph, pipelined: PipelinedScans, bodies: dict, cost: CostModel
) -> tuple[tuple[int, int, np.ndarray], ...]:
    """The alternating 1F1B schedule (`autopar.lower.pipeline`) runs `2 (M + S - 1)`
    half-slots, in each some stages a forward pass and the others a backward one, so
    a half-slot lasts the slower of the two: `2 (M + S - 1) max(f, b)` in all, where
    the two loops' own prices (`loop_times`, lock-step slots) add up to
    `(M + S - 1) (f + b)`. The difference, `(M + S - 1) |f - b|`, depends on both
    loops' strategies: per fused pair (forward, backward, its matrix). The head runs
    `M` times between half-slots, priced per micro-batch as the lock-step head is."""
    pipe = pipelined.pipe
    if pipe.schedule != "1f1b-async":
        return ()
    ticks = pipe.microbatches + pipe.stages - 1
    out = []
    for fz in pipelined.fused:
        f, b = (
            np.array(
                [_slot_seconds(graph.nodes[i], bodies[i][0], pipe, cost, r) for r in bodies[i][1]]
            )
            for i in (fz.forward, fz.backward)
        )
        out.append((fz.forward, fz.backward, ticks * np.abs(f[:, None] - b[None, :])))
    return tuple(out)


def _carry_bytes(node: Node, body: Problem, result: SearchResult) -> int:
    """Each device's shard of one micro-batch's carry as a layer returns it (`result`:
    one layer's plan at the micro-batch size, on the `body` problem): the layout the
    lowering pins a stage's carry to and passes on to the next stage. (The next layer
    may read it in another; that reshard is in the body's price.)"""
    g, total = body.graph, 0
    for k in range(node.params["num_carry"]):
        if k in body.aliases:  # returned as it came in
            total += _value_bytes(body, result, g.inputs[body.aliases[k]])
        elif g.outputs[k] in body.source:
            total += _value_bytes(body, result, g.outputs[k])
        else:  # a constant
            total += g.values[g.outputs[k]].nbytes
    return total


def _slot_seconds(
    node: Node, body: Problem, pipe: Pipeline, cost: CostModel, result: SearchResult
) -> float:
    """One slot of a pipelined scan: one micro-batch through one stage's layers (one
    chunk's, interleaved) and one collective-permute of its carry (`_carry_bytes`) to
    the next stage."""
    return (
        chunk_layers(node, pipe) * result.cost.step_s + _hop(node, body, pipe, cost, result).seconds
    )


def _hop(node: Node, body: Problem, pipe: Pipeline, cost: CostModel, result: SearchResult):
    """The collective-permute of one micro-batch's carry (`_carry_bytes`) to the next stage."""
    return cost.collective("collective-permute", (pipe.axis,), _carry_bytes(node, body, result))


def residency(graph: Graph, pipelined: PipelinedScans | None) -> dict[int, float]:
    """`Problem.resident`: the fraction of each value alive at once (1 where absent). A
    fill that only pipelined loops read, each stage rebuilding one micro-batch's worth
    (`sunk_fills`), is never made: 0. (Its batch-free operand, read by the loops
    instead, is priced alive up to the broadcast only: at most 1/batch of the fill.)"""
    if pipelined is None:
        return {}
    fills = sunk_fills(graph, pipelined)
    sunk = {(c, k) for c, ks in fills.items() for k in ks}
    out = {
        v: 0.0
        for v in {made.outputs[0] for ks in fills.values() for made in ks.values()}
        if v not in graph.outputs
        and all(
            (c, k) in sunk
            for c in graph.consumers.get(v, ())
            for k, x in enumerate(graph.nodes[c].inputs)
            if x == v
        )
    }
    if pipelined.head_nodes():
        out.update(_fused_residency(graph, pipelined))
    for v, extra in _stage_loop_copies(graph, pipelined).items():
        out[v] = out.get(v, 1.0) + extra
    return out


def _stage_loop_copies(graph: Graph, pipelined: PipelinedScans) -> dict[int, float]:
    """A stage runs its layers (or a chunk of them) as a loop nested in the schedule's
    loop. Where that inner loop has more than one layer, XLA writes its stacked saved
    activations for the micro-batch into a buffer of their own and then copies them into
    the slot that keeps them (and reads a slot back the same way): one more micro-batch
    of the stage's saved activations alive at once, `1 / M` of each forward loop's `ys`
    the backward reads. A one-layer loop is inlined, with no copy. Measured on XLA:CPU
    (GPT of hidden 64 on 2 stages, lock-step 1F1B): without this term the compiled
    temporaries were 1.24x the prediction at 2 layers a stage (`benchmarks.schedules`)
    and 1.32x at 4; one layer a stage matched (0.92-0.97x). (ZB-H1's weight-gradient
    loop reads a slot the same way: `pipeline_buffers`.)"""
    pipe, out = pipelined.pipe, {}
    scans = set(pipelined.scans)
    for i in pipelined.scans:
        node = graph.nodes[i]
        if chunk_layers(node, pipe) <= 1:
            continue
        for v in node.outputs[node.params["num_carry"] :]:
            if any(c in scans and c != i for c in graph.consumers.get(v, ())):
                out[v] = 1 / (pipe.microbatches * pipe.virtual)
    return out


def _fused_residency(graph: Graph, pipelined: PipelinedScans) -> dict[int, float]:
    """In a 1F1B pipeline a stage holds the saved activations of at most 2S - 1
    micro-batches (lock-step) or S (alternating: stage s holds S - s, and every stage
    has the first stage's buffer), or, interleaved, `(v + 1) S - 1` chunks' of the `M
    v` (`interleaved_slots`), and the whole of one the rest of the step reads too; the
    head's values one micro-batch's worth, but for the values the rest of the step
    reads from it."""
    pipe = pipelined.pipe
    S, V = pipe.stages, pipe.virtual
    held = S if pipe.schedule == "1f1b-async" else 2 * S - 1
    if V > 1:
        held = interleaved_slots(S, pipe.microbatches, V)[0]
    M = pipe.microbatches * V  # saved activations by chunk of a stage's layers
    out = {}
    for fz in pipelined.fused:
        F, B = graph.nodes[fz.forward], graph.nodes[fz.backward]
        members = fz.members()
        # a per-layer result the rest of the step reads is gathered whole besides
        read = set(graph.outputs) | {
            v for n in graph.nodes if n.id not in members for v in n.inputs
        }
        for v in F.outputs[F.params["num_carry"] :]:
            if v in B.inputs:
                out[v] = min(M, held) / M + (v in read)
        kept = {v for v, _ in fz.head_outs}
        for h in fz.head:
            out.update((v, 1 / M) for v in graph.nodes[h].outputs if v not in kept)
    return out


def _inside_1f1b(graph: Graph, pipelined: PipelinedScans) -> set[int]:
    """The 1F1B forward loops whose final carry only the head reads: it never leaves
    the pipeline."""
    out = set()
    for fz in pipelined.fused:
        F, members = graph.nodes[fz.forward], fz.members()
        carry = set(F.outputs[: F.params["num_carry"]])
        if carry & set(graph.outputs):
            continue
        if all(n.id in members for n in graph.nodes if carry & set(n.inputs)):
            out.add(fz.forward)
    return out
