"""Layer transplants: one repeated layer's strategies copied onto another, op for op.

An engine can leave one layer of a repeated stack in a layout of its own: D-Rec decides
the first layer's ops before the others, and a GPT-2 step on data 2 x model 2 x expert
2 kept layer 0's MLP split over `expert` on its hidden dim between batch-split
neighbours (eight reshards, in its forward and in its backward pass) where layers 1-3
ran data parallel. No single-op move, and no forest of the descent, removes it: the
layer's forward and backward ops read each other's values, so a move of the whole
layer, forward and backward at once, is what helps. The layers themselves say which
move: another layer's plan.

`transplant` labels the nodes by layer (`search.layers.layer_labels`: the name's
indexed segment, `h_3`, `layers/3`), pairs the nodes of two layers of a family by their
name with the layer index blanked, op and occurrence (a first layer that also holds the
embedding's ops pairs what it shares with the others), and tries each layer with each
of the most common other plans of its family: a node takes its partner's strategy where
their strategy lists are equal and it is not pinned. A copy is kept where it lowers the
objective (`node_time` plus the edges touching the moved nodes), until no copy does.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence

from autopar.search.build import Problem
from autopar.search.layers import layer_labels

# Per target layer, the most common plans of its family tried as sources.
SOURCES = 3


def transplant(problem: Problem, choice: Sequence[int], pinned: Mapping[int, int]) -> list[int]:
    """`choice` with layer transplants (module docstring) that lower the objective."""
    from autopar.search.engines import neighbour_tables

    out = list(choice)
    layers = _layers(problem)
    if not layers:
        return out
    nb = neighbour_tables(problem)
    strategies, node_time = problem.strategies, problem.node_time

    def local(moved: set[int], plan: Sequence[int]) -> float:
        total = 0.0
        for v in moved:
            total += float(node_time[v][plan[v]])
            for u, m in nb[v]:
                if u not in moved or u < v:
                    total += float(m[plan[u], plan[v]])
        return total

    improved = True
    while improved:
        improved = False
        for family in layers.values():
            plans = {i: tuple(out[v] for v in nodes.values()) for i, nodes in family.items()}
            common = [p for p, _ in Counter(plans.values()).most_common(SOURCES)]
            for j, target in family.items():
                for plan in common:
                    if plan == plans[j]:
                        continue
                    source = next((i for i in family if plans[i] == plan), None)
                    if source is None:  # its only layer took another plan meanwhile
                        continue
                    moves = {
                        v: out[u]
                        for key, v in target.items()
                        if (u := family[source].get(key)) is not None
                        and v not in pinned
                        and out[v] != out[u]
                        and (strategies[v] is strategies[u] or strategies[v] == strategies[u])
                    }
                    if not moves:
                        continue
                    moved = set(moves)
                    trial = list(out)
                    for v, s in moves.items():
                        trial[v] = s
                    if local(moved, trial) < local(moved, out) - 1e-12:
                        out, improved = trial, True
                        plans[j] = tuple(out[v] for v in target.values())
                        break
    return out


_INDEX = re.compile(r"\d+")


def _layers(problem: Problem) -> dict[str, dict[int, dict[tuple, int]]]:
    """Per family of at least two layers, per layer index, its nodes keyed by (name with
    the layer's index blanked, op, occurrence)."""
    g, n_in = problem.graph, problem.num_inputs
    names = [*g.input_paths, *(n.name_stack for n in g.nodes)]
    out: dict[str, dict[int, dict[tuple, int]]] = {}
    seen: Counter = Counter()
    for v, lab in enumerate(layer_labels(problem)):
        if lab is None:
            continue
        family, i = lab
        op = "input" if v < n_in else g.nodes[v - n_in].op
        name = _INDEX.sub("#", names[v])
        key = (name, op)
        seen[(family, i, key)] += 1
        out.setdefault(family, {}).setdefault(i, {})[(*key, seen[(family, i, key)])] = v
    return {f: layers for f, layers in out.items() if len(layers) >= 2}
