"""Forest descent: improve a plan of a cost graph by re-solving random induced forests
exactly (docs/algorithms.md, section 3), the polish `dp` applies where graph
elimination had to guess part of the graph."""

from __future__ import annotations

import collections
import math

import numpy as np

__all__ = ["RTOL", "forest_descent"]

# Relative tolerance under which two plan values count as equal.
RTOL = 1e-12


def _solve_forest(nodes: list[int], cost: dict, adj: dict) -> dict[int, int]:
    """Exact plan of a forest over ``nodes`` (ascending ids; ``adj[v][y]`` the
    ``[S_v, S_y]`` matrix of each forest edge): ``_Eliminator.run`` restricted to the
    ``root`` and ``leaf`` steps a forest needs, in the same order and with the same
    arithmetic (so the same plan), without the general eliminator's bookkeeping."""
    cost = dict(cost)
    minimum = np.minimum.reduce  # ndarray.min without its Python wrapper
    # (node, neighbour or -1, the edge's matrix): the strategies are read back from the
    # node's final cost and one column of the matrix (the same sums as the full table
    # `m + cost[x][:, None]`, which is not kept: on wide meshes it is ~S^2 per node)
    log: list[tuple[int, int, np.ndarray | None]] = []
    low = collections.deque(x for x in nodes if len(adj[x]) <= 1)
    done: set[int] = set()
    while low:
        x = low.popleft()
        if x in done:
            continue
        done.add(x)
        if not adj[x]:
            log.append((x, -1, None))
            continue
        ((u, m),) = adj[x].items()
        cost[u] = cost[u] + minimum(m + cost[x][:, None], axis=0)
        log.append((x, u, m))
        del adj[u][x]
        adj[x] = {}
        if len(adj[u]) <= 1:
            low.append(u)
    if len(done) != len(nodes):
        raise ValueError("_solve_forest needs a forest; the graph has a cycle")
    choice: dict[int, int] = {}
    for x, u, m in reversed(log):  # cost[x] is final once x is eliminated
        choice[x] = int((cost[x] if u < 0 else m[:, choice[u]] + cost[x]).argmin())
    return choice


class _Pricer:
    """A plan's value (its node costs plus its edge costs) for many plans of one graph:
    every node's and edge's entries flattened once, so a plan's terms are gathered by
    one index and summed by ``fsum`` (exactly rounded: the same value, to the last bit,
    whatever the order of the terms)."""

    def __init__(self, cost, edges):
        self.node_off = np.cumsum([0] + [len(c) for c in cost[:-1]]).astype(np.int64)
        self.nodes = np.concatenate([np.asarray(c, dtype=np.float64) for c in cost])
        pairs = list(edges.items())
        self.eu = np.array([u for (u, _), _ in pairs], dtype=np.int64)
        self.ev = np.array([v for (_, v), _ in pairs], dtype=np.int64)
        self.width = np.array([m.shape[1] for _, m in pairs], dtype=np.int64)
        sizes = [m.size for _, m in pairs]
        self.edge_off = np.cumsum([0] + sizes[:-1]).astype(np.int64)
        self.edges = (
            np.concatenate([np.asarray(m, dtype=np.float64).ravel() for _, m in pairs])
            if pairs
            else np.zeros(0)
        )

    def __call__(self, choice) -> float:
        c = np.asarray(choice, dtype=np.int64)
        terms = self.nodes[self.node_off + c]
        if len(self.eu):
            at = self.edge_off + c[self.eu] * self.width + c[self.ev]
            terms = np.concatenate([terms, self.edges[at]])
        return math.fsum(terms.tolist())


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
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (u, v), m in edges.items():
        nbrs[u].append((v, m))
        nbrs[v].append((u, m.T))
    ids = [[y for y, _ in nb] for nb in nbrs]
    rng = np.random.default_rng(0)
    price = _Pricer(cost, edges) if n else (lambda c: 0.0)
    choice = list(choice)
    value = price(choice)
    stale = rounds = 0

    while rounds < max_rounds and stale < patience:
        rounds += 1
        parent = list(range(n))  # union-find over the forest being grown
        in_t = [False] * n
        for v in rng.permutation(n).tolist():
            roots = []
            for y in ids[v]:
                if in_t[y]:
                    while parent[y] != y:
                        parent[y] = parent[parent[y]]
                        y = parent[y]
                    roots.append(y)
            if len(set(roots)) == len(roots):
                in_t[v] = True
                for r in roots:
                    parent[r] = v
        t_nodes = [v for v in range(n) if in_t[v]]
        sub_cost, adj = {}, {}
        for v in t_nodes:
            c, a = cost[v], {}
            for y, m in nbrs[v]:
                if in_t[y]:
                    a[y] = m
                else:
                    c = c + m[:, choice[y]]
            sub_cost[v], adj[v] = c, a
        sub = _solve_forest(t_nodes, sub_cost, adj)
        trial = list(choice)
        for v, s in sub.items():
            trial[v] = s
        new = price(trial)
        if new < value - RTOL * abs(value):
            choice, value, stale = trial, new, 0
        else:
            stale += 1
    return choice, rounds
