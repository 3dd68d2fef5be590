"""Price a complete choice of strategies: time split into compute and
communication, collectives by mesh axis and kind, and per-device peak memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.cost import Collective
from autopar.search.problem import Problem


@dataclass(frozen=True)
class Cost:
    compute_s: float
    comm_s: float
    peak_memory_bytes: int
    argument_bytes: int
    comm_bytes: dict[str, int] = field(default_factory=dict)  # "kind@axes" -> bytes

    @property
    def step_s(self) -> float:
        """No-overlap step time: compute plus communication."""
        return self.compute_s + self.comm_s

    def to_json(self) -> dict:
        return {
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "step_s": self.step_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "argument_bytes": self.argument_bytes,
            "comm_bytes": dict(sorted(self.comm_bytes.items())),
        }

    @staticmethod
    def from_json(d: dict) -> Cost:
        return Cost(
            d["compute_s"],
            d["comm_s"],
            int(d["peak_memory_bytes"]),
            int(d.get("argument_bytes", 0)),
            dict(d.get("comm_bytes", {})),
        )


def total_time(problem: Problem, choice: Sequence[int]) -> float:
    t = sum(float(problem.node_time[v][s]) for v, s in enumerate(choice))
    return t + sum(float(m[choice[u], choice[v]]) for (u, v), m in problem.edges.items())


def edge_collectives(problem: Problem, choice: Sequence[int]) -> list[tuple[int, Collective]]:
    """(consumer cost-graph node, collective) for every reshard the plan pays."""
    g, n_in, strategies = problem.graph, problem.num_inputs, problem.strategies
    out: list[tuple[int, Collective]] = []
    for node in g.nodes:
        v = n_in + node.id
        for j, x in enumerate(node.inputs):
            if x not in problem.source:
                continue
            u, k = problem.source[x]
            r = problem.cost.reshard(
                g.values[x],
                strategies[u][choice[u]].out_specs[k],
                strategies[v][choice[v]].in_specs[j],
            )
            out.extend((v, c) for c in r.collectives)
    for o, x in enumerate(g.outputs):
        if x not in problem.source:
            continue
        u, k = problem.source[x]
        spec = strategies[u][choice[u]].out_specs[k]
        target = spec.without_partial()
        if o in problem.aliases:
            i = problem.aliases[o]
            target = strategies[i][choice[i]].out_specs[0]
        r = problem.cost.reshard(g.values[x], spec, target)
        out.extend((u, c) for c in r.collectives)
    return out


def evaluate(problem: Problem, choice: Sequence[int]) -> Cost:
    compute = sum(float(problem.node_time[v][s]) for v, s in enumerate(choice))
    colls = edge_collectives(problem, choice)
    by: dict[str, int] = {}
    for _, c in colls:
        key = f"{c.kind}@{','.join(c.axes)}"
        by[key] = by.get(key, 0) + c.bytes
    comm = sum(c.seconds for _, c in colls)
    peak, args = peak_memory(problem, choice)
    return Cost(compute, comm, peak, args, by)


def peak_memory(problem: Problem, choice: Sequence[int]) -> tuple[int, int]:
    """(peak, argument) bytes per device: arguments stay live throughout; each
    intermediate lives from its producer to its last consumer (outputs to the end)."""
    g, n_in = problem.graph, problem.num_inputs
    args = int(sum(problem.node_mem[i][choice[i]] for i in range(n_in)))
    last_use: dict[int, int] = {}
    for node in g.nodes:
        for x in node.inputs:
            last_use[x] = node.id
    for x in g.outputs:
        last_use[x] = len(g.nodes)
    free_at = np.zeros(len(g.nodes) + 1)
    live = peak = 0.0
    for node in g.nodes:
        s = problem.strategies[n_in + node.id][choice[n_in + node.id]]
        for v, spec in zip(node.outputs, s.out_specs):
            b = problem.cost.local_bytes(g.values[v], spec)
            live += b
            free_at[last_use.get(v, node.id)] += b
        peak = max(peak, live)
        live -= free_at[node.id]
    return int(args + peak), args
