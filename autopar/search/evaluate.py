"""Price a complete choice of strategies: time split into compute and
communication, collectives by mesh axis and kind, and per-device peak memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from autopar.cost.model import FUSED_OPS, Collective, Cost
from autopar.ir.graph import Graph
from autopar.search.build import Problem
from autopar.search.combiner import combined_latency
from autopar.sharding import Spec
from autopar.strategies.settle import settle_partials

# (the specs the function's outputs are returned in, the settled spec of each partial
# value): `settle`
Settled = tuple[list[Spec], dict[int, Spec]]


def total_time(problem: Problem, choice: Sequence[int]) -> float:
    t = sum(float(problem.node_time[v][s]) for v, s in enumerate(choice))
    return t + sum(float(m[choice[u], choice[v]]) for (u, v), m in problem.edges.items())


def edge_collectives(
    problem: Problem, choice: Sequence[int], settled: Settled | None = None
) -> list[tuple[int, int | None, Collective]]:
    """(producer, consumer, collective) cost-graph nodes for every reshard the plan pays;
    the consumer is None for a function output. Uses of one value that want the same
    spec share one reshard, as XLA computes it once (the search's pairwise edge costs
    still count each use: a conservative overestimate). A partial value is summed once,
    into its settled spec (`settle_partials`), where the first use that reads it is,
    and every use reads it from there, as the lowering does: summing it again for each
    spec its uses want priced a reduce-scatter and an all-reduce of the same gradient
    where the program has one all-reduce. `settled`: `settle(problem, choice)`, when
    the caller has it."""
    g, n_in, strategies = problem.graph, problem.num_inputs, problem.strategies
    source, values, reshard = problem.source, g.values, problem.cost.reshard
    out: list[tuple[int, int | None, Collective]] = []
    seen: set[tuple[int, Spec | None]] = set()
    targets, settled = settled or settle(problem, choice)
    chosen = [strategies[i][c] for i, c in enumerate(choice)]

    def pay(x: int, src: Spec, dst: Spec, at: int | None) -> None:
        if (x, dst) in seen:
            return
        seen.add((x, dst))
        u = source[x][0]
        stored = settled.get(x, src) if src.partial else src
        if stored != src:  # the sum, once
            if (x, None) not in seen:
                seen.add((x, None))
                out.extend((u, at, c) for c in reshard(values[x], src, stored).collectives)
            src = stored
        out.extend((u, at, c) for c in reshard(values[x], src, dst).collectives)

    for node in g.nodes:
        v = n_in + node.id
        wants = chosen[v].in_specs
        for j, x in enumerate(node.inputs):
            if x in source:
                u, k = source[x]
                src, dst = chosen[u].out_specs[k], wants[j]
                if (src is dst or src == dst) and not src.partial:
                    continue  # read as it is stored: nothing to pay
                pay(x, src, dst, v)
    for x, target in zip(g.outputs, targets):
        if x in source:
            u, k = source[x]
            pay(x, chosen[u].out_specs[k], target, None)
    return out


def output_spec(problem: Problem, o: int, pick: Callable[[int], int]) -> Spec:
    """The spec function output `o` is returned in when node `n` runs strategy
    `pick(n)`: an updated argument keeps the argument's spec; anything else its
    producer's, summed if partial (unless the problem lets that output stay partial)."""
    v = problem.graph.outputs[o]
    if o in problem.aliases:
        i = problem.aliases[o]
        return problem.strategies[i][pick(i)].out_specs[0]
    if v in problem.source:
        u, k = problem.source[v]
        spec = problem.strategies[u][pick(u)].out_specs[k]
        return spec if o in problem.partial_outputs else spec.without_partial()
    return Spec.replicated(problem.graph.values[v].rank)


def output_specs(problem: Problem, choice: Sequence[int]) -> list[Spec]:
    return [output_spec(problem, o, choice.__getitem__) for o in range(len(problem.graph.outputs))]


def settle(problem: Problem, choice: Sequence[int]) -> Settled:
    """Where each partial sum of the plan is summed (`settle_partials`), with the specs
    the outputs are returned in: the collectives and the memory walk both read it."""
    g, n_in = problem.graph, problem.num_inputs
    strat = [problem.strategies[n_in + n.id][choice[n_in + n.id]] for n in g.nodes]
    targets = output_specs(problem, choice)
    return targets, settle_partials(
        g, [s.in_specs for s in strat], [s.out_specs for s in strat], targets
    )


def _times(problem: Problem, choice: Sequence[int], settled: Settled | None = None):
    """(compute seconds, communication seconds with all-reduces combined, collectives)."""
    colls = edge_collectives(problem, choice, settled)
    node_compute = problem.compute_time()
    compute = sum(float(node_compute[v][s]) for v, s in enumerate(choice))
    compute += problem.wait_time(choice)
    comm = sum(c.seconds for _, _, c in colls) - combined_latency(problem, colls)
    return compute, comm, colls


def step_seconds(problem: Problem, choice: Sequence[int]) -> float:
    """`evaluate(...).step_s` without the memory walk."""
    compute, comm, _ = _times(problem, choice)
    return compute + comm


def evaluate(problem: Problem, choice: Sequence[int]) -> Cost:
    """The plan's price: compute and communication seconds (a loop's own collectives,
    `Problem.loop_comm`, counted as communication), bytes per collective kind and mesh
    axes (a loop's every step's), peak memory."""
    settled = settle(problem, choice)
    compute, comm, colls = _times(problem, choice, settled)
    by: dict[str, int] = {}
    for _, _, c in colls:
        axes = sorted(c.axes, key=problem.mesh.axis_names.index)
        key = f"{c.kind}@{','.join(axes)}"
        by[key] = by.get(key, 0) + c.bytes
    n_in = problem.num_inputs
    for i, per in problem.loop_comm.items():
        seconds, sent = per[choice[n_in + i]]
        compute, comm = compute - seconds, comm + seconds
        for key, b in sent.items():
            by[key] = by.get(key, 0) + int(b)
    peak, args = peak_memory(problem, choice, settled)
    return Cost(compute, comm, peak, args, by)


def fused_away(g: Graph, strat: Sequence, out_spec: dict[int, Spec]) -> set[int]:
    """Values XLA never writes to memory: made by an elementwise or shape op (FUSED_OPS)
    for exactly one such op to read, in the layout it is made in, and not returned. They
    live inside one fused kernel; the compute model already prices them so
    (`facts.hbm_traffic`, which also counts values read by several fused ops as
    never written). Counting those here as well made the prediction fall 8-30% below
    XLA's for float32 GPT, ViT and Wide-ResNet steps; XLA materializes many of them."""
    out: set[int] = set()
    for v, c, positions in g.memo(_fusable):
        want = out_spec[v]
        if all(strat[c].in_specs[j] == want for j in positions):
            out.add(v)
    return out


def _fusable(g: Graph) -> list[tuple[int, int, tuple[int, ...]]]:
    """(value, its reader, the reader's operand positions that read it) of every value
    `fused_away` may drop, whatever the plan: made by a FUSED_OPS op, read by one
    FUSED_OPS op alone, not returned."""
    returned = set(g.outputs)
    fused = [n.op in FUSED_OPS for n in g.nodes]
    out = []
    for n in g.nodes:
        if not fused[n.id]:
            continue
        for v in n.outputs:
            readers = g.consumers.get(v, ())
            if v in returned or len(readers) != 1 or not fused[readers[0]]:
                continue
            c = readers[0]
            out.append((v, c, tuple(j for j, x in enumerate(g.nodes[c].inputs) if x == v)))
    return out


def peak_memory(
    problem: Problem, choice: Sequence[int], settled: Settled | None = None
) -> tuple[int, int]:
    """(peak, argument) bytes per device: arguments stay live throughout; each
    intermediate lives from its producer to its last consumer (outputs to the end),
    at the size of its settled spec (`settle_partials`). A value fused away
    (`fused_away`) takes no memory; its reads keep its own operands alive instead. An
    op that reads a value in another layout than it is stored in (an all-gathered
    weight, a loop's stacked weights gathered for the whole loop) holds that copy
    while it runs. A 1F1B region (`Problem.regions`) runs as one loop: everything its
    ops make is alive, and every copy they read held, from its first op to its last,
    as are the pipeline's own buffers (`Problem.buffers`).
    `settled`: `settle(problem, choice)`, when the caller has it."""
    g, n_in = problem.graph, problem.num_inputs
    nodes, values, strategies = g.nodes, g.values, problem.strategies
    strat = [strategies[n_in + n.id][choice[n_in + n.id]] for n in nodes]
    settled = (settled or settle(problem, choice))[1]
    args = int(sum(problem.node_mem[i][choice[i]] for i in range(n_in)))
    made = {
        v: settled.get(v, sp) if sp.partial else sp
        for n, s in zip(nodes, strat)
        for v, sp in zip(n.outputs, s.out_specs)
    }
    stored = {v: strategies[i][choice[i]].out_specs[0] for i, v in enumerate(g.inputs)}
    stored.update(made)  # every value in the layout it is stored in
    virtual = fused_away(g, strat, made)
    # each op's span: itself, or its region's first and last op
    n_ops = len(nodes)
    start = list(range(n_ops))
    end = list(range(n_ops))
    for region in problem.regions:
        lo, hi = min(region), max(region)
        for i in region:
            start[i], end[i] = lo, hi
    roots: dict[int, frozenset[int]] = {}
    last_use: dict[int, int] = {}
    for node, s in zip(nodes, strat):
        lo, hi = start[node.id], end[node.id]
        for x, want in zip(node.inputs, s.in_specs):
            # read as a copy, a value is needed only while the copy is made (a
            # region's: at its start); in its own layout, while the reader runs
            held = stored.get(x)
            at = lo if held is not None and want is not held and want != held else hi
            for r in roots[x] if x in virtual else (x,):
                if last_use.get(r, -1) < at:
                    last_use[r] = at
        for v in node.outputs:
            if v in virtual:
                roots[v] = frozenset(
                    r for x in node.inputs for r in (roots[x] if x in virtual else (x,))
                )
    for x in g.outputs:
        last_use[x] = n_ops
    made_at = [0.0] * (n_ops + 1)  # bytes allocated at each op
    free_at = [0.0] * (n_ops + 1)  # bytes freed after each op
    copied: set[tuple[int, int, Spec]] = set()  # (span's first op, value, layout)
    local_bytes, resident = problem.cost.local_bytes, problem.resident
    for node, s in zip(nodes, strat):
        at, hi = start[node.id], end[node.id]
        for x, want in zip(node.inputs, s.in_specs):  # copies, held while the op runs
            held = stored.get(x)
            if held is None or want is held or want == held or (at, x, want) in copied:
                continue
            copied.add((at, x, want))  # one copy serves a whole region
            b = local_bytes(values[x], want) * resident.get(x, 1.0)
            made_at[at] += b
            free_at[hi] += b
        for v in node.outputs:
            if v in virtual:
                continue
            b = local_bytes(values[v], stored[v]) * resident.get(v, 1.0)
            made_at[at] += b
            free_at[max(last_use.get(v, node.id), hi)] += b
    for i, buffer in problem.buffers.items():  # a pipeline's own buffers, its whole region
        b = float(buffer[choice[n_in + i]])
        made_at[start[i]] += b
        free_at[end[i]] += b
    live = np.cumsum(made_at) - np.concatenate(([0.0], np.cumsum(free_at)[:-1]))
    return int(args + max(0.0, float(live[:n_ops].max(initial=0.0)))), args


def memory_floor(graph: Graph, devices: int, resident: dict[int, float] | None = None) -> float:
    """A floor under `peak_memory` of every plan of `graph` on `devices` devices (a
    pipelined graph's: `resident`, its `Problem.resident`): the arguments, and at each
    op the values made before it that no plan fuses away (`fused_away` needs a
    FUSED_OPS value read once, by a FUSED_OPS op, and not returned), alive from their
    producer to their last direct reader, each split over every device. A plan stores
    each at least that long (a fused reader keeps it longer) and at least that size
    (replicas and partial sums are larger). Used to drop a try no plan of which can
    fit before building it."""
    resident = resident or {}
    last: dict[int, int] = {}
    for node in graph.nodes:
        for x in node.inputs:
            last[x] = node.id
    for x in graph.outputs:
        last[x] = len(graph.nodes)
    fused = [n.op in FUSED_OPS for n in graph.nodes]
    returned = set(graph.outputs)
    free_at = np.zeros(len(graph.nodes) + 1)
    live = peak = 0.0
    for node in graph.nodes:
        for v in node.outputs:
            readers = graph.consumers.get(v, ())
            if fused[node.id] and v not in returned and len(readers) == 1 and fused[readers[0]]:
                continue  # a plan may keep it inside one fused kernel
            b = graph.values[v].nbytes * resident.get(v, 1.0)
            live += b
            free_at[last.get(v, node.id)] += b
        peak = max(peak, live)
        live -= free_at[node.id]
    args = sum(graph.values[v].nbytes for v in graph.inputs)
    return (args + peak) / devices
