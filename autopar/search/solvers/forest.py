"""Forest descent: improve a plan of a cost graph by re-solving random induced forests
exactly (docs/algorithms.md, section 3), the polish `dp` applies where graph
elimination had to guess part of the graph. A round's work is one compiled function
(`solvers.kernels`)."""

from __future__ import annotations

import math

import numpy as np

from autopar.search.solvers.kernels import FlatGraph, flat_graph, round_kernel

__all__ = ["RTOL", "forest_descent"]

# Relative tolerance under which two plan values count as equal.
RTOL = 1e-12


def forest_descent(cost, edges, choice, max_rounds: int = 30, patience: int = 3):
    """Improve a heuristic plan by re-solving random induced forests exactly.

    o---o---o        each round picks a random set T of nodes with no cycle
    |   |   |        among them (x), holds the others (o) at their current
    x---x---o        strategies, folds their edges into T's node costs and
    |   |   |        solves T exactly by elimination (leaf and op only).
    o---x---x        The plan never gets worse; stop after ``patience``
                     rounds without improvement.
    """
    n = len(cost)
    choice = list(choice)
    if n == 0:  # no round finds anything to improve
        return choice, min(max_rounds, patience)
    graph = flat_graph(cost, edges)
    rng = np.random.default_rng(0)
    current = np.array(choice, dtype=np.int64)
    value = _price(graph, current)
    stale = rounds = 0
    while rounds < max_rounds and stale < patience:
        rounds += 1
        trial = current.copy()
        if not round_kernel(graph, rng.permutation(n), current, trial):
            raise ValueError("forest descent needs a forest; the graph has a cycle")
        new = _price(graph, trial)
        if new < value - RTOL * abs(value):
            current, value, stale = trial, new, 0
        else:
            stale += 1
    return current.tolist(), rounds


def _price(g: FlatGraph, choice: np.ndarray) -> float:
    """The plan's node costs plus edge costs, summed by ``fsum`` (exactly rounded: the
    same value, to the last bit, whatever the order of the terms)."""
    terms = g.nodes[g.node_off + choice]
    if len(g.edge_u):
        at = g.edge_at + choice[g.edge_u] * g.edge_width + choice[g.edge_v]
        terms = np.concatenate([terms, g.flat[at]])
    return math.fsum(terms.tolist())
