"""Forest descent: improve a plan of a cost graph by re-solving random induced forests
exactly (docs/algorithms.md, section 3), the polish `dp` applies where graph
elimination had to guess part of the graph. A round's work is one compiled function
(`solvers.kernels`)."""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np

from autopar.search.solvers.kernels import FlatGraph, flat_graph, round_kernel

__all__ = ["RTOL", "forest_descent"]

# Relative tolerance under which two plan values count as equal.
RTOL = 1e-12


def forest_descent(
    cost,
    edges,
    choice,
    max_rounds: int = 30,
    patience: int = 3,
    random: bool = True,
    pinned: Collection[int] | None = None,
):
    """Improve a heuristic plan by re-solving random induced forests exactly.

    o---o---o        each round picks a random set T of nodes with no cycle
    |   |   |        among them (x), holds the others (o) at their current
    x---x---o        strategies, folds their edges into T's node costs and
    |   |   |        solves T exactly by elimination (leaf and op only).
    o---x---x        The plan never gets worse; stop after ``patience``
                     rounds without improvement.

    Every other round is a *cone* round: T is grown first from the node that costs the
    plan most above its cheapest strategy (its regret: its own cost, and the edges it
    reads, at the current plan) through its producers (lower-numbered neighbours,
    breadth first), or in the round after through its consumers, then the other nodes
    at random; the next cone rounds start from the next node by regret until a round
    improves. A random T seldom holds a whole chain that only moves at once: a clipped
    optimizer's global norm carried as a Partial sum through the adds of every
    gradient's square sum, one all-reduce at the root that an exact solve of its
    upstream tree removes (a tiny Llama on 8 devices: ``dp`` 1.55x the ILP before, at
    the optimum with it). With ``random`` False every round is a cone round, and the
    descent stops when no node has a regret left to try. With ``pinned``, those nodes
    and the ones with a single strategy stay as they are.
    """
    n = len(cost)
    choice = list(choice)
    if n == 0:  # no round finds anything to improve
        return choice, min(max_rounds, patience)
    graph = flat_graph(cost, edges)
    rng = np.random.default_rng(0)
    current = np.array(choice, dtype=np.int64)
    value = _price(graph, current)
    free = None
    if pinned is not None:
        free = graph.size > 1
        free[list(pinned)] = False
    cones = _Cones(graph, free)
    stale = rounds = 0
    while rounds < max_rounds and stale < patience:
        rounds += 1
        order = rng.permutation(n)
        if free is not None:
            order = order[free[order]]
        if rounds % 2 == 0 or not random:
            cone = cones.order(current, order)
            if cone is None and not random:
                break
            order = order if cone is None else cone
        trial = current.copy()
        if not round_kernel(graph, order, current, trial):
            raise ValueError("forest descent needs a forest; the graph has a cycle")
        new = _price(graph, trial)
        if new < value - RTOL * abs(value):
            current, value, stale = trial, new, 0
            cones.tried.clear()
        else:
            stale += 1
    return current.tolist(), rounds


class _Cones:
    """The cone rounds' orders (`forest_descent`): a node's producers, then (its next
    round) its consumers, breadth first (scipy's, on the graph's edges oriented by node
    number: the graph is numbered in program order), then the rest as given."""

    def __init__(self, g: FlatGraph, free: np.ndarray | None):
        from scipy.sparse import csr_matrix

        n = len(g.size)
        hi, lo = np.maximum(g.edge_u, g.edge_v), np.minimum(g.edge_u, g.edge_v)
        up = csr_matrix((np.ones(len(hi)), (hi, lo)), shape=(n, n))
        self.ways = (up, up.T.tocsr())
        self.g, self.free, self.tried = g, free, set()
        self.cheapest = np.minimum.reduceat(g.nodes, g.node_off) if n else g.nodes

    def order(self, choice: np.ndarray, rest: np.ndarray) -> np.ndarray | None:
        """The next cone's order, then `rest`; None when no node is left to try."""
        from scipy.sparse.csgraph import breadth_first_order

        g = self.g
        regret = g.nodes[g.node_off + choice] - self.cheapest
        if len(g.edge_u):
            np.add.at(regret, np.maximum(g.edge_u, g.edge_v), _edge_costs(g, choice))
        for v in np.argsort(-regret, kind="stable"):
            if regret[v] <= 0:
                return None
            way = next((w for w in (0, 1) if (int(v), w) not in self.tried), None)
            if way is not None:
                break
        else:
            return None
        self.tried.add((int(v), way))
        cone = breadth_first_order(self.ways[way], int(v), directed=True, return_predecessors=False)
        taken = np.zeros(len(g.size), bool)
        taken[cone] = True
        if self.free is not None:
            cone = cone[self.free[cone]]
        return np.concatenate([cone, rest[~taken[rest]]])


def _price(g: FlatGraph, choice: np.ndarray) -> float:
    """The plan's node costs plus edge costs, summed by ``fsum`` (exactly rounded: the
    same value, to the last bit, whatever the order of the terms)."""
    terms = g.nodes[g.node_off + choice]
    if len(g.edge_u):
        terms = np.concatenate([terms, _edge_costs(g, choice)])
    return math.fsum(terms.tolist())


def _edge_costs(g: FlatGraph, choice: np.ndarray) -> np.ndarray:
    """Each edge's cost at the plan `choice`."""
    return g.flat[g.edge_at + choice[g.edge_u] * g.edge_width + choice[g.edge_v]]
