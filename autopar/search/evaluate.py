"""Price a complete choice of strategies: time split into compute and
communication, collectives by mesh axis and kind, and per-device peak memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from autopar.cost.model import Collective, Cost
from autopar.ir.graph import Graph
from autopar.search import memory
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
    peak, args = memory.peak_memory(problem, choice, settled[1], settled[0])
    return Cost(compute, comm, peak, args, by)


def peak_memory(
    problem: Problem, choice: Sequence[int], settled: Settled | None = None
) -> tuple[int, int]:
    """(peak, argument) bytes per device of the plan (`memory.peak_memory`).
    `settled`: `settle(problem, choice)`, when the caller has it."""
    targets, partials = settled or settle(problem, choice)
    return memory.peak_memory(problem, choice, partials, targets)


def memory_floor(graph: Graph, devices: int, resident: dict[int, float] | None = None) -> float:
    """A floor under `peak_memory` of every plan of `graph` on `devices` devices (a
    pipelined graph's: `resident`, its `Problem.resident`): the arguments, and at each
    op the values made before it that no plan fuses away (`memory.peak_memory` fuses away a
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
    fusable = memory.fusable(graph)
    free_at = np.zeros(len(graph.nodes) + 1)
    live = peak = 0.0
    for node in graph.nodes:
        for v in node.outputs:
            if v in fusable:
                continue  # a plan may keep it inside one fused kernel
            b = graph.values[v].nbytes * resident.get(v, 1.0)
            live += b
            free_at[last.get(v, node.id)] += b
        peak = max(peak, live)
        live -= free_at[node.id]
    args = sum(graph.values[v].nbytes for v in graph.inputs)
    return (args + peak) / devices
