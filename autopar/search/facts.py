"""What building a problem reads of the graph alone, computed once per graph
(`Graph.memo`): the shapes of a mesh-shape search, the tries of one call, share it.
Each node's strategy key and FLOPs, each cost-graph node's operand kinds and the HBM
traffic of XLA's fusions."""

from __future__ import annotations

import networkx as nx
import numpy as np

from autopar.cost.model import FUSED_OPS, node_flops
from autopar.ir.graph import Graph


def graph_flops(graph: Graph) -> float:
    """All FLOPs of one run of `graph`, loops at their length."""
    return sum(run_flops(node, graph) for node in graph.nodes)


def run_flops(node, graph: Graph) -> float:
    """The FLOPs of one run of `node`: a loop's body at its length, a cond's costliest
    branch."""
    if node.body is not None:
        return node.params["length"] * graph_flops(node.body)
    if node.branches is not None:  # the costliest branch
        return max(graph_flops(b) for b in node.branches)
    return node_flops(node, graph)


def flops_each(graph: Graph) -> list[float]:
    """`run_flops` of each node, once per graph."""
    return [run_flops(node, graph) for node in graph.nodes]


def node_facts(graph: Graph) -> tuple[list, np.ndarray]:
    """Per node, once per graph (the shapes of a mesh-shape search share them): its
    `node_key` (None for a loop, whose strategies come from its body's search) and its
    FLOPs (a cond's costliest branch)."""
    keys = [node_key(n, graph) if n.body is None else None for n in graph.nodes]
    each = graph.memo(flops_each)  # `run_flops`: a loop's differs, its own op's is kept
    flops = [node_flops(n, graph) if n.body is not None else f for n, f in zip(graph.nodes, each)]
    return keys, np.array(flops, dtype=np.float64)


def node_key(node, graph):
    try:
        key = (
            node.op,
            tuple(graph.values[v] for v in node.inputs),
            tuple(graph.values[v] for v in node.outputs),
            tuple(sorted(node.params.items())),
        )
        hash(key)
        return key
    except TypeError:
        return None


def node_kinds(graph: Graph) -> tuple[list, list, list[int]]:
    """Per cost-graph node (arguments first), once per graph: its operand types, its
    result types, and a number shared by the nodes alike in both, in their HBM traffic
    (`hbm_traffic`) and in being an argument or an op."""
    n_in = len(graph.inputs)
    ins = [()] * n_in + [tuple(graph.values[v] for v in n.inputs) for n in graph.nodes]
    outs = [(graph.values[v],) for v in graph.inputs] + [
        tuple(graph.values[v] for v in n.outputs) for n in graph.nodes
    ]
    traffic = graph.memo(hbm_traffic)
    number: dict = {}
    kind = [
        number.setdefault(
            (ins[c], outs[c], c < n_in, traffic[c - n_in] if c >= n_in else None), len(number)
        )
        for c in range(len(ins))
    ]
    return ins, outs, kind


def hbm_traffic(graph: Graph) -> list[tuple[tuple[bool, ...], tuple[bool, ...]] | None]:
    """Per node, which operands it reads from and which results it writes to HBM:
    None for all of them. XLA fuses chains of elementwise and shape ops (FUSED_OPS)
    into one kernel, so such an op reads only operands made outside its chain (by a
    heavy op, or arguments) and writes only results that leave it (read by a heavy
    op, or returned); values passed along the chain never touch HBM. A value that
    several ops of one chain read is read once (by the first of them): an optimizer
    update reads a parameter's gradient in its first- and second-moment terms, and
    XLA's multi-output fusion loads it once. Chains are the fused ops joined by the
    values they pass, except scalars, whose producers XLA copies into every consumer's
    kernel (an Adam step's bias corrections would otherwise join every parameter's
    update into one chain)."""
    fused = [n.op in FUSED_OPS for n in graph.nodes]
    producer, consumers = graph.producer, graph.consumers
    returned = set(graph.outputs)
    chains = nx.utils.UnionFind()
    for n in graph.nodes:
        if fused[n.id]:
            chains[n.id]  # noqa: B018 - every fused op is a chain of its own at first
            for v in n.inputs:
                p = producer.get(v)
                if p is not None and fused[p] and graph.values[v].rank:
                    chains.union(p, n.id)
    loaded: set[tuple[int, int]] = set()  # (chain, value) read from HBM already
    out: list = []
    for n in graph.nodes:
        if not fused[n.id]:
            out.append(None)
            continue
        chain = chains[n.id]
        reads = []
        for v in n.inputs:
            outside = not (v in producer and fused[producer[v]])
            reads.append(outside and (chain, v) not in loaded)
            if outside:
                loaded.add((chain, v))
        writes = tuple(
            v in returned or any(not fused[c] for c in consumers.get(v, ())) for v in n.outputs
        )
        out.append((tuple(reads), writes))
    return out
