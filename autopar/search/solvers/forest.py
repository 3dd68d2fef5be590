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
# Within one wave of leaves, the matrices of one small shape are read side by side from
# this many on; below it, or for a larger matrix (more than STACKED entries, whose
# arithmetic outweighs an array operation's fixed cost), one by one.
BATCH = 4
STACKED = 4096


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
    value = graph.price(choice)
    stale = rounds = 0

    while rounds < max_rounds and stale < patience:
        rounds += 1
        parent = list(range(n))  # union-find over the forest being grown
        in_t = [False] * n
        for v in rng.permutation(n).tolist():
            roots = []
            for y in graph.nbrs[v]:
                if in_t[y]:
                    while parent[y] != y:
                        parent[y] = parent[parent[y]]
                        y = parent[y]
                    roots.append(y)
            if len(set(roots)) == len(roots):
                in_t[v] = True
                for r in roots:
                    parent[r] = v
        nodes = [v for v in range(n) if in_t[v]]
        mask = np.array(in_t)
        held = graph.held(mask, np.array(choice, dtype=np.int64))
        trial = list(choice)
        for v, s in graph.solve(nodes, mask, held).items():
            trial[v] = s
        new = graph.price(trial)
        if new < value - RTOL * abs(value):
            choice, value, stale = trial, new, 0
        else:
            stale += 1
    return choice, rounds


class _Forests:
    """A cost graph as the descent prices plans of it and re-solves forests of it, the
    sums of the one-node-at-a-time elimination done many nodes per array operation
    where they can be, in the same order: minima are exact and `np.add.at` applies
    repeated targets in sequence, so a forest gets the same plan to the last bit.

    Each edge is kept both ways: directed edge ``d`` runs from ``src[d]`` to ``dst[d]``
    (``d ^ 1`` is the same edge the other way) with matrix ``mats[d]`` of shape
    ``[S_src, S_dst]`` (the edge's matrix or a view of its transpose). Every node's and
    edge's entries are flattened once (``nodes``, ``flat``). Node costs are also rows of
    an ``[n, width]`` array padded with inf, and the matrices of each small shape,
    rounded up to a multiple of 8, are stacked transposed and padded with 0 (``stack``):
    a padded strategy never wins a minimum."""

    def __init__(self, cost, edges):
        n = len(cost)
        self.n = n
        self.size = np.array([len(c) for c in cost], dtype=np.int64)
        self.nodes = np.concatenate([np.asarray(c, dtype=np.float64) for c in cost])
        self.node_off = np.cumsum(self.size) - self.size
        self.cost = np.full((n, _rounded(int(self.size.max()))), np.inf)
        self.cost[np.repeat(np.arange(n), self.size), self._within(self.size)] = self.nodes
        pairs = [((u, v), np.asarray(m, dtype=np.float64)) for (u, v), m in edges.items()]
        self.flat = np.concatenate([m.ravel() for _, m in pairs]) if pairs else np.zeros(0)
        sizes = np.array([m.size for _, m in pairs], dtype=np.int64)
        self.mats: list[np.ndarray] = []
        self.nbrs: list[list[int]] = [[] for _ in range(n)]  # in the edges' order
        by_src: list[list[int]] = [[] for _ in range(n)]
        src, dst = [], []
        # column j of mats[d] in `flat`: at + j * step + i * stride, i < S_src
        at, step, stride = [], [], []
        for ((u, v), m), o in zip(pairs, (np.cumsum(sizes) - sizes).tolist()):
            for x, y, md, a, b in ((u, v, m, 1, m.shape[1]), (v, u, m.T, m.shape[1], 1)):
                by_src[x].append(len(self.mats))
                self.nbrs[x].append(y)
                self.mats.append(md)
                src.append(x)
                dst.append(y)
                at.append(o)
                step.append(a)
                stride.append(b)
        self.src, self.dst = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
        self.dst_of = dst
        self.at, self.step, self.stride = (np.array(a, dtype=np.int64) for a in (at, step, stride))
        self.by_src = np.array([d for ds in by_src for d in ds], dtype=np.int64)
        self.edge_u, self.edge_v = self.src[::2], self.dst[::2]
        self.edge_at, self.edge_width = self.at[::2], self.stride[::2]
        shapes: dict[tuple[int, int], list[int]] = {}
        for d, m in enumerate(self.mats):
            if m.size <= STACKED:
                shapes.setdefault((_rounded(m.shape[1]), _rounded(m.shape[0])), []).append(d)
        self.group = [-1] * len(self.mats)
        self.slot = [0] * len(self.mats)
        self.stack: list[np.ndarray] = []
        for g, (shape, ds) in enumerate(shapes.items()):
            stack = np.zeros((len(ds), *shape))
            for k, d in enumerate(ds):
                self.group[d], self.slot[d] = g, k
                stack[k, : self.mats[d].shape[1], : self.mats[d].shape[0]] = self.mats[d].T
            self.stack.append(stack)

    @staticmethod
    def _within(lens: np.ndarray) -> np.ndarray:
        """``concatenate([arange(k) for k in lens])``."""
        return np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)

    def price(self, choice) -> float:
        """The plan's node costs plus edge costs, summed by ``fsum`` (exactly rounded:
        the same value, to the last bit, whatever the order of the terms)."""
        c = np.asarray(choice, dtype=np.int64)
        terms = self.nodes[self.node_off + c]
        if len(self.edge_u):
            at = self.edge_at + c[self.edge_u] * self.edge_width + c[self.edge_v]
            terms = np.concatenate([terms, self.flat[at]])
        return math.fsum(terms.tolist())

    def held(self, in_t: np.ndarray, choice: np.ndarray) -> np.ndarray:
        """Node costs with every edge to a node outside the forest folded in at that
        node's strategy: ``cost[v] + m[:, choice[y]]``, neighbour by neighbour in the
        edges' order."""
        c = self.cost.copy()
        ds = self.by_src[in_t[self.src[self.by_src]] & ~in_t[self.dst[self.by_src]]]
        if len(ds):
            lens = self.size[self.src[ds]]
            i = self._within(lens)
            col = self.at[ds] + choice[self.dst[ds]] * self.step[ds]
            pos = np.repeat(col, lens) + i * np.repeat(self.stride[ds], lens)
            np.add.at(c, (np.repeat(self.src[ds], lens), i), self.flat[pos])
        return c

    def waves(self, nodes: list[int], in_t: np.ndarray) -> list[list[tuple[int, int]]]:
        """The order a queue of leaves eliminates the forest ``nodes`` (ascending) in,
        cut into waves (wave k+1: the nodes wave k left with one neighbour or none):
        (node, its edge to the neighbour it folds into, or -1 for a root). A node folds
        once all its other neighbours folded into it, in earlier waves. A node's one
        remaining neighbour is the sum of its remaining neighbours' ids (and its edge
        the sum of their edges' ids)."""
        both = np.flatnonzero(in_t[self.src] & in_t[self.dst])
        s, n = self.src[both], self.n
        deg = np.bincount(s, minlength=n).tolist()
        nsum = np.bincount(s, weights=self.dst[both], minlength=n).astype(np.int64).tolist()
        esum = np.bincount(s, weights=both, minlength=n).astype(np.int64).tolist()
        low = collections.deque((x, 0) for x in nodes if deg[x] <= 1)
        done = [False] * n
        waves: list[list[tuple[int, int]]] = []
        while low:
            x, wave = low.popleft()
            if done[x]:
                continue
            done[x] = True
            if wave == len(waves):
                waves.append([])
            if not deg[x]:
                waves[wave].append((x, -1))
                continue
            u, d = nsum[x], esum[x]
            waves[wave].append((x, d))
            deg[x] = 0
            deg[u] -= 1
            nsum[u] -= x
            esum[u] -= d ^ 1
            if deg[u] <= 1:
                low.append((u, wave + 1))
        if sum(map(len, waves)) != len(nodes):
            raise ValueError("forest descent needs a forest; the graph has a cycle")
        return waves

    def solve(self, nodes: list[int], in_t: np.ndarray, held: np.ndarray) -> dict[int, int]:
        """Exact plan of the forest ``nodes`` with node costs ``held`` (changed in place):
        every leaf folded into its neighbour u (``held[u] += min_i m[i, :] + held[x][i]``)
        wave by wave, the sums added in the queue's order; then each node's strategy read
        back in reverse from its neighbour's."""
        waves = self.waves(nodes, in_t)
        shared = []  # each wave's folds by stacked shape, read again to pick strategies
        for wave in waves:
            folds = [(x, d) for x, d in wave if d >= 0]
            gains: list = [None] * len(folds)
            shared.append(list(self._shared(folds)))
            for part, xs, ds, stack in shared[-1]:
                if stack is None:
                    for k, x, d in zip(part, xs, ds):
                        m = self.mats[d]
                        gains[k] = np.minimum.reduce(m + held[x, : m.shape[0], None], axis=0)
                    continue
                table = stack[[self.slot[d] for d in ds]] + held[xs, None, : stack.shape[2]]
                for k, gain in zip(part, np.minimum.reduce(table, axis=2)):
                    gains[k] = gain  # padded to the stack's width: inf + anything is inf
            for (_, d), gain in zip(folds, gains):
                held[self.dst_of[d], : len(gain)] += gain
        choice = [0] * self.n
        for wave, groups in zip(reversed(waves), reversed(shared)):
            roots = [x for x, d in wave if d < 0]
            for x, s in zip(roots, held[roots].argmin(axis=1).tolist()):
                choice[x] = s
            for _, xs, ds, stack in groups:
                if stack is None:
                    for x, d in zip(xs, ds):
                        col = self.mats[d][:, choice[self.dst_of[d]]]
                        choice[x] = int((col + held[x, : len(col)]).argmin())
                    continue
                cols = stack[[self.slot[d] for d in ds], [choice[self.dst_of[d]] for d in ds]]
                for x, s in zip(xs, (cols + held[xs, : stack.shape[2]]).argmin(axis=1).tolist()):
                    choice[x] = s
        return {v: choice[v] for v in nodes}

    def _shared(self, folds: list[tuple[int, int]]):
        """``folds`` (node, edge) by stacked shape: (their positions in ``folds``, their
        nodes, their edges, the stack), the stack None where fewer than ``BATCH`` of them
        share one (each is then read alone)."""
        shared: dict[int, list[int]] = {}
        for k, (_, d) in enumerate(folds):
            shared.setdefault(self.group[d], []).append(k)
        for g, ks in shared.items():
            xs = [folds[k][0] for k in ks]
            ds = [folds[k][1] for k in ks]
            yield ks, xs, ds, (self.stack[g] if g >= 0 and len(ks) >= BATCH else None)


def _rounded(k: int) -> int:
    return -(-k // 8) * 8
