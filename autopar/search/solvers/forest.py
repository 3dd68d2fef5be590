"""Forest descent: improve a plan of a cost graph by re-solving random induced forests
exactly (docs/algorithms.md, section 3), the polish `dp` applies where graph
elimination had to guess part of the graph.

A round's work (grow the forest, fold the held neighbours' edges into its nodes,
eliminate it leaf by leaf, read the strategies back) is one function compiled by
`numba`: it walks nodes and edges one at a time, which Python does slowly and array
operations batch poorly (a layer's chain of ops eliminates one node at a time). It is
compiled on first use and cached on disk (numba's cache, next to this file or in the
user's cache directory): a process loads it in ~0.3 s (`warm`), the first ever
compiles it in ~1.5 s."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["RTOL", "forest_descent", "warm"]

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
    graph = _Forests(cost, edges)
    rng = np.random.default_rng(0)
    current = np.array(choice, dtype=np.int64)
    value = graph.price(current)
    stale = rounds = 0
    while rounds < max_rounds and stale < patience:
        rounds += 1
        trial = graph.round(rng.permutation(n), current)
        new = graph.price(trial)
        if new < value - RTOL * abs(value):
            current, value, stale = trial, new, 0
        else:
            stale += 1
    return current.tolist(), rounds


class _Forests:
    """A cost graph as the descent prices plans of it and re-solves forests of it.

    Each edge is kept both ways: directed edge ``d`` runs from ``src[d]`` to ``dst[d]``
    (``d ^ 1`` is the same edge the other way); entry ``[i, j]`` of its matrix (``i``
    a strategy of ``src[d]``, ``j`` of ``dst[d]``) is ``flat[at[d] + j * step[d] + i *
    stride[d]]``, every edge's entries flattened once. Node costs are rows of an
    ``[n, width]`` array padded with inf; a node's directed edges are
    ``adj[adj_ptr[v]:adj_ptr[v + 1]]``, in the edges' order."""

    def __init__(self, cost, edges):
        n = len(cost)
        self.size = np.array([len(c) for c in cost], dtype=np.int64)
        self.nodes = np.concatenate([np.asarray(c, dtype=np.float64) for c in cost])
        self.node_off = np.cumsum(self.size) - self.size
        self.cost = np.full((n, int(self.size.max())), np.inf)
        within = np.arange(len(self.nodes)) - np.repeat(self.node_off, self.size)
        self.cost[np.repeat(np.arange(n), self.size), within] = self.nodes
        pairs = [((u, v), np.asarray(m, dtype=np.float64)) for (u, v), m in edges.items()]
        self.flat = np.concatenate([m.ravel() for _, m in pairs]) if pairs else np.zeros(0)
        e = len(pairs)
        u = np.array([p[0][0] for p in pairs], dtype=np.int64)
        v = np.array([p[0][1] for p in pairs], dtype=np.int64)
        width = np.array([m.shape[1] for _, m in pairs], dtype=np.int64)
        sizes = np.array([m.size for _, m in pairs], dtype=np.int64)
        offset = np.cumsum(sizes) - sizes
        self.src, self.dst = np.empty(2 * e, np.int64), np.empty(2 * e, np.int64)
        self.src[0::2], self.src[1::2], self.dst[0::2], self.dst[1::2] = u, v, v, u
        self.at = np.repeat(offset, 2)
        self.step, self.stride = np.empty(2 * e, np.int64), np.empty(2 * e, np.int64)
        self.step[0::2], self.step[1::2] = 1, width
        self.stride[0::2], self.stride[1::2] = width, 1
        order = np.argsort(self.src, kind="stable")  # by node, in the edges' order
        self.adj = order.astype(np.int64)
        self.adj_ptr = np.concatenate([[0], np.cumsum(np.bincount(self.src, minlength=n))])
        self.edge_u, self.edge_v, self.edge_at, self.edge_width = u, v, offset, width

    def price(self, choice: np.ndarray) -> float:
        """The plan's node costs plus edge costs, summed by ``fsum`` (exactly rounded:
        the same value, to the last bit, whatever the order of the terms)."""
        terms = self.nodes[self.node_off + choice]
        if len(self.edge_u):
            at = self.edge_at + choice[self.edge_u] * self.edge_width + choice[self.edge_v]
            terms = np.concatenate([terms, self.flat[at]])
        return math.fsum(terms.tolist())

    def round(self, order: np.ndarray, choice: np.ndarray) -> np.ndarray:
        """`choice` with the forest grown in `order` re-solved exactly."""
        trial = choice.copy()
        ok = _kernel()(
            order, choice, trial, self.adj_ptr, self.adj, self.src, self.dst, self.at,
            self.step, self.stride, self.flat, self.cost, self.size,
        )  # fmt: skip
        if not ok:
            raise ValueError("forest descent needs a forest; the graph has a cycle")
        return trial


_compiled: Callable | None = None


def _kernel() -> Callable:
    """`_round` compiled (numba is imported on first use, not with autopar)."""
    global _compiled
    if _compiled is None:
        import numba

        _compiled = numba.njit(cache=True, nogil=True)(_round)
    return _compiled


def warm() -> None:
    """Load (or compile) the kernel now: before forking search workers, so that each
    does not load it again."""
    forest_descent([np.zeros(2), np.zeros(2)], {(0, 1): np.eye(2)}, [0, 0], 1, 1)


def _round(order, choice, trial, adj_ptr, adj, src, dst, at, step, stride, flat, cost, size):
    """One round (`forest_descent`) into `trial`; False if the nodes taken hold a cycle.

    The forest T: each node in `order` joins T unless two of its neighbours in T are
    in one tree of T (union-find). Its node costs `held`: each node's row plus, edge by
    edge, the column of a neighbour outside T at that neighbour's strategy. Then a queue
    of T's leaves (ascending, then as they appear) folds each leaf x into its one
    remaining neighbour u: ``held[u, j] += min_i (m[i, j] + held[x, i])``; a node with
    no neighbour left is a root. Last, in reverse, each root takes its cheapest
    strategy and each leaf the one cheapest against its neighbour's (the first such)."""
    n = len(size)
    parent = np.arange(n)
    in_t = np.zeros(n, np.bool_)
    seen = np.full(n, -1)
    roots = np.empty(n, np.int64)
    for v in order:
        k = 0
        dup = False
        for a in range(adj_ptr[v], adj_ptr[v + 1]):
            y = dst[adj[a]]
            if in_t[y]:
                while parent[y] != y:
                    parent[y] = parent[parent[y]]
                    y = parent[y]
                if seen[y] == v:
                    dup = True
                seen[y] = v
                roots[k] = y
                k += 1
        if not dup:
            in_t[v] = True
            for r in range(k):
                parent[roots[r]] = v
    held = cost.copy()
    deg = np.zeros(n, np.int64)
    nsum = np.zeros(n, np.int64)
    esum = np.zeros(n, np.int64)
    for x in range(n):
        if not in_t[x]:
            continue
        for a in range(adj_ptr[x], adj_ptr[x + 1]):
            d = adj[a]
            y = dst[d]
            if in_t[y]:
                deg[x] += 1
                nsum[x] += y
                esum[x] += d
            else:
                col = at[d] + choice[y] * step[d]
                for i in range(size[x]):
                    held[x, i] += flat[col + i * stride[d]]
    queue = np.empty(2 * n, np.int64)  # a node is queued at most twice (deg 1, then 0)
    edge = np.empty(n, np.int64)
    done = np.zeros(n, np.bool_)
    head = tail = 0
    for x in range(n):
        if in_t[x] and deg[x] <= 1:
            queue[tail] = x
            tail += 1
    seq = 0  # nodes eliminated so far: order_x[:seq], each with its edge or -1
    order_x = np.empty(n, np.int64)
    while head < tail:
        x = queue[head]
        head += 1
        if done[x]:
            continue
        done[x] = True
        order_x[seq] = x
        if deg[x] == 0:
            edge[seq] = -1
            seq += 1
            continue
        u, d = nsum[x], esum[x]
        edge[seq] = d
        seq += 1
        for j in range(size[u]):
            base = at[d] + j * step[d]
            best = np.inf
            for i in range(size[x]):
                c = flat[base + i * stride[d]] + held[x, i]
                if c < best:
                    best = c
            held[u, j] += best
        deg[x] = 0
        deg[u] -= 1
        nsum[u] -= x
        esum[u] -= d ^ 1
        if deg[u] <= 1:
            queue[tail] = u
            tail += 1
    count = 0
    for x in range(n):
        if in_t[x]:
            count += 1
    if seq != count:
        return False
    for s in range(seq - 1, -1, -1):
        x, d = order_x[s], edge[s]
        best = held[x, 0]
        pick = 0
        if d < 0:
            for i in range(1, size[x]):
                if held[x, i] < best:
                    best, pick = held[x, i], i
        else:
            base = at[d] + trial[dst[d]] * step[d]
            best = flat[base] + held[x, 0]
            for i in range(1, size[x]):
                c = flat[base + i * stride[d]] + held[x, i]
                if c < best:
                    best, pick = c, i
        trial[x] = pick
    return True
