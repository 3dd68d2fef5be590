"""Forest descent: improve a plan of a cost graph by re-solving random induced forests
exactly (docs/algorithms.md, section 3), the polish `dp` applies where graph
elimination had to guess part of the graph."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["RTOL", "forest_descent"]

# Relative tolerance under which two plan values count as equal.
RTOL = 1e-12


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + l)`` for each start ``s`` and length ``l``."""
    total = int(lengths.sum())
    skip = np.cumsum(lengths) - lengths  # where each range begins in the output
    return np.repeat(starts - skip, lengths) + np.arange(total, dtype=np.int64)


def _first_argmin(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``argmin`` of each consecutive segment of ``values`` (first minimum, as
    ``ndarray.argmin``; segments of ``lengths``, none empty)."""
    starts = np.cumsum(lengths) - lengths
    low = np.minimum.reduceat(values, starts)
    at = np.arange(len(values), dtype=np.int64) - np.repeat(starts, lengths)
    hit = np.where(values == np.repeat(low, lengths), at, np.iinfo(np.int64).max)
    return np.minimum.reduceat(hit, starts)


class _Flat:
    """A cost graph laid out for numpy steps over many nodes at once.

    ``cost``: node costs padded to ``[n, width]`` (the pad is never read). ``buf``: per
    directed edge ``d = (v, y)`` (``src``/``dst``, grouped by ``v`` in the order
    ``v``'s edges were given) a block at ``off[d]`` holding ``B_d[c, r]``, the cost of
    ``v`` in strategy ``r`` with ``y`` in ``c``, row-major, so that the column ``v``
    gathers for one strategy of ``y``, or minimizes over for each, is contiguous; then
    per node ``v`` a block of ``size[v]`` zeros at ``own[v]`` (``v``'s costs alone).
    Aligned with ``buf``: ``cell`` (the entry of ``cost.ravel()`` that entry adds to:
    ``v``'s row, ``r``'s column), ``head`` (True where a column begins) and ``out``
    (at a column's head, the entry of ``cost.ravel()`` of ``y``'s strategy ``c``)."""

    def __init__(self, cost, edges):
        n = len(cost)
        self.size = np.array([len(c) for c in cost], dtype=np.int64)
        self.width = w = int(self.size.max()) if n else 1
        dtype = np.result_type(*cost, *edges.values()) if n else np.float64
        self.cost = np.zeros((n, w), dtype=dtype)
        for v, c in enumerate(cost):
            self.cost[v, : len(c)] = c
        src, dst, blocks = [], [], []
        for (u, v), m in edges.items():
            src += [u, v]
            dst += [v, u]
            blocks += [np.asarray(m).T, np.asarray(m)]  # B_(u,v) = m.T, B_(v,u) = m
        order = np.argsort(np.array(src, dtype=np.int64), kind="stable")
        self.src = np.array(src, dtype=np.int64)[order]
        self.dst = np.array(dst, dtype=np.int64)[order]
        rows, cols = self.size[self.src], self.size[self.dst]
        sizes = rows * cols
        self.off = np.cumsum(sizes) - sizes
        self.own = int(sizes.sum()) + np.cumsum(self.size) - self.size
        self.buf = np.concatenate(
            [np.asarray(blocks[i], dtype=dtype).ravel() for i in order]
            + [np.zeros(int(self.size.sum()), dtype=dtype)]
        )
        # per column (of the edge blocks, then the own blocks): where it begins in
        # `buf`, its length and the entry of `cost.ravel()` its minimum goes to
        rows = np.concatenate([rows, self.size])
        cols = np.concatenate([cols, np.ones(n, dtype=np.int64)])
        owner = np.concatenate([self.src, np.arange(n, dtype=np.int64)])
        target = np.concatenate([self.dst, np.arange(n, dtype=np.int64)])
        first = np.cumsum(cols) - cols
        c = np.arange(int(cols.sum()), dtype=np.int64) - np.repeat(first, cols)
        heads = np.repeat(np.concatenate([self.off, self.own]), cols) + c * np.repeat(rows, cols)
        self.head = np.zeros(len(self.buf), dtype=bool)
        self.head[heads] = True
        self.out = np.zeros(len(self.buf), dtype=np.int64)
        self.out[heads] = np.repeat(target, cols) * w + c
        per = np.repeat(rows, cols)  # each column's length
        self.cell = np.repeat(np.repeat(owner, cols) * w - heads, per) + np.arange(
            len(self.buf), dtype=np.int64
        )
        self.ids = [[] for _ in range(n)]  # per node: its neighbours, in edge order
        for v, y in zip(self.src.tolist(), self.dst.tolist()):
            self.ids[v].append(y)
        at = np.empty_like(order)
        at[order] = np.arange(len(order))
        self.rev = at[order ^ 1].tolist()  # the edge the other way: given as a pair

    def folded(self, in_t: np.ndarray, choice: np.ndarray) -> np.ndarray:
        """Node costs of the forest ``in_t`` with every edge to a node outside it folded
        in at that node's strategy (added in each node's edge order)."""
        cost = self.cost.copy()
        d = np.flatnonzero(in_t[self.src] & ~in_t[self.dst])
        lengths = self.size[self.src[d]]
        at = _ranges(self.off[d] + choice[self.dst[d]] * lengths, lengths)
        np.add.at(cost.reshape(-1), self.cell[at], self.buf[at])
        return cost

    def solve(self, t_nodes: list[int], in_t: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """Exact plan of the forest ``t_nodes`` (ascending) on the folded ``cost``: leaves
        eliminated into their neighbours in waves (the nodes that became leaves in the
        wave before; a wave's messages computed together), then strategies read back
        wave by wave in reverse. The eliminations happen in the order, and with the
        arithmetic, of the one-leaf-at-a-time elimination (docs/algorithms.md, section
        3), so the plan is the same."""
        # each node's live forest degree and the XOR of its live neighbours (and edges
        # to them): a leaf's one neighbour is the XOR
        both = np.flatnonzero(in_t[self.src] & in_t[self.dst])
        n = len(self.size)
        deg = np.bincount(self.src[both], minlength=n).tolist()
        near, edge = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        np.bitwise_xor.at(near, self.src[both], self.dst[both])
        np.bitwise_xor.at(edge, self.src[both], both)
        near, edge, rev = near.tolist(), edge.tolist(), self.rev
        done = [False] * n
        roots: list[int] = []
        waves: list[list[tuple[int, int, int]]] = []
        wave = [x for x in t_nodes if deg[x] <= 1]
        while wave:
            step, later = [], []
            for x in wave:
                if done[x]:
                    continue
                done[x] = True
                if not deg[x]:
                    roots.append(x)
                    continue
                u, d = near[x], edge[x]
                step.append((x, u, d))
                deg[x] = 0
                deg[u] -= 1
                near[u] ^= x
                edge[u] ^= rev[d]
                if deg[u] <= 1:
                    later.append(u)
            if step:
                waves.append(step)
            wave = later
        if sum(map(len, waves)) + len(roots) != len(t_nodes):
            raise ValueError("forest descent needs a forest; the graph has a cycle")
        choice = np.zeros(n, dtype=np.int64)
        waves = [np.array(w, dtype=np.int64) for w in waves]
        flat = cost.reshape(-1)
        for x, u, d in (wave.T for wave in waves):  # cost[u][c] += min_r B_d[c, r] + cost[x][r]
            at = _ranges(self.off[d], self.size[x] * self.size[u])
            t = self.buf[at] + flat[self.cell[at]]
            heads = np.flatnonzero(self.head[at])
            np.add.at(flat, self.out[at[heads]], np.minimum.reduceat(t, heads))
        x = np.array(roots, dtype=np.int64)  # each tree's last node: it holds the tree
        choice[x] = self._best(self.own[x], self.size[x], flat)
        for x, u, d in (wave.T for wave in reversed(waves)):
            rows = self.size[x]
            choice[x] = self._best(self.off[d] + choice[u] * rows, rows, flat)
        return choice

    def _best(self, starts: np.ndarray, rows: np.ndarray, flat: np.ndarray) -> np.ndarray:
        """Per segment of ``buf`` (``starts``, ``rows`` long): the strategy minimizing
        the segment plus its node's cost (first minimum, as ``argmin``)."""
        at = _ranges(starts, rows)
        return _first_argmin(self.buf[at] + flat[self.cell[at]], rows)


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
    flat = _Flat(cost, edges)
    ids = flat.ids
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
            if len(roots) < 2 or len(set(roots)) == len(roots):
                in_t[v] = True
                for r in roots:
                    parent[r] = v
        t_nodes = [v for v in range(n) if in_t[v]]
        mask = np.array(in_t, dtype=bool)
        sub = flat.solve(t_nodes, mask, flat.folded(mask, np.asarray(choice, dtype=np.int64)))
        trial = np.where(mask, sub, choice).tolist()
        new = price(trial)
        if new < value - RTOL * abs(value):
            choice, value, stale = trial, new, 0
        else:
            stale += 1
    return choice, rounds
