"""The search's node-by-node loops, compiled by `numba`: a cost graph flattened into
arrays (`FlatGraph`), one forest-descent round (`solvers.forest`) and iterated
conditional modes (`search.engines.refine`).

These loops walk nodes and edges one at a time (a layer's chain of ops eliminates one
node at a time; a refinement visits every node in order), which Python does slowly
and numpy's array operations batch poorly (~2-3 us of fixed cost each). Compiled, each
keeps the arithmetic of the Python it replaced, in the same order (each sum one
rounding, minima exact, the first minimum kept), so plans are the same to the last bit.

numba is imported on first use, not with autopar. The functions are compiled once per
installation into numba's disk cache (next to this file, or the user's cache directory
where this one is not writable; ~3 s) and loaded once per process (~0.3 s, `warm`;
the planner loads them before it forks search workers, `search.workers`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["FlatGraph", "flat_graph", "minplus", "refine_kernel", "round_kernel", "warm"]


@dataclass(frozen=True, eq=False)
class FlatGraph:
    """A cost graph (node costs, edge matrices) as arrays.

    Each edge ``e`` is kept both ways: directed edge ``d = 2e`` runs from its first node
    to its second, ``d = 2e + 1`` back (``d ^ 1`` is the other way); entry ``[i, j]`` of
    its matrix (``i`` a strategy of ``src[d]``, ``j`` of ``dst[d]``) is ``flat[at[d] + j
    * step[d] + i * stride[d]]``. Node costs are rows of ``cost`` (``[n, width]``,
    padded with inf); a node's directed edges are ``adj[adj_ptr[v]:adj_ptr[v + 1]]``,
    in the edges' order. ``nodes``/``node_off`` hold the node costs flattened, and
    ``edge_*`` each undirected edge's nodes, offset and row width (for pricing)."""

    size: np.ndarray
    nodes: np.ndarray
    node_off: np.ndarray
    cost: np.ndarray
    flat: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    at: np.ndarray
    step: np.ndarray
    stride: np.ndarray
    adj: np.ndarray
    adj_ptr: np.ndarray
    edge_u: np.ndarray
    edge_v: np.ndarray
    edge_at: np.ndarray
    edge_width: np.ndarray


def flat_graph(cost, edges) -> FlatGraph:
    """`cost` (one vector per node) and `edges` ({(u, v): [S_u, S_v]}, u != v) as a
    `FlatGraph`, once per pair of objects (neither may change afterwards: a problem's
    tables, a presolved graph that several descents start from)."""
    for held_cost, held_edges, flat in _FLAT:
        if held_cost is cost and held_edges is edges:
            return flat
    flat = _flatten(cost, edges)
    _FLAT.append((cost, edges, flat))  # held, so neither id is reused while cached
    return flat


_FLAT: deque = deque(maxlen=4)


def _flatten(cost, edges) -> FlatGraph:
    n = len(cost)
    size = np.array([len(c) for c in cost], dtype=np.int64)
    nodes = np.concatenate([np.asarray(c, dtype=np.float64) for c in cost])
    node_off = np.cumsum(size) - size
    padded = np.full((n, int(size.max())), np.inf)
    within = np.arange(len(nodes)) - np.repeat(node_off, size)
    padded[np.repeat(np.arange(n), size), within] = nodes
    pairs = [((u, v), np.asarray(m, dtype=np.float64)) for (u, v), m in edges.items()]
    if any(u == v for (u, v), _ in pairs):
        raise ValueError("a cost graph's edge joins two distinct nodes")
    flat = np.concatenate([m.ravel() for _, m in pairs]) if pairs else np.zeros(0)
    u = np.array([p[0][0] for p in pairs], dtype=np.int64)
    v = np.array([p[0][1] for p in pairs], dtype=np.int64)
    width = np.array([m.shape[1] for _, m in pairs], dtype=np.int64)
    sizes = np.array([m.size for _, m in pairs], dtype=np.int64)
    offset = np.cumsum(sizes) - sizes
    e = len(pairs)
    src, dst = np.empty(2 * e, np.int64), np.empty(2 * e, np.int64)
    src[0::2], src[1::2], dst[0::2], dst[1::2] = u, v, v, u
    step, stride = np.empty(2 * e, np.int64), np.empty(2 * e, np.int64)
    step[0::2], step[1::2], stride[0::2], stride[1::2] = 1, width, width, 1
    adj = np.argsort(src, kind="stable").astype(np.int64)  # by node, in the edges' order
    adj_ptr = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=n))]).astype(np.int64)
    return FlatGraph(
        size, nodes, node_off, padded, flat, src, dst, np.repeat(offset, 2), step, stride,
        adj, adj_ptr, u, v, offset, width,
    )  # fmt: skip


_compiled: dict[str, Callable] = {}


def _jit(fn: Callable) -> Callable:
    if fn.__name__ not in _compiled:
        import numba

        _compiled[fn.__name__] = numba.njit(cache=True, nogil=True)(fn)
    return _compiled[fn.__name__]


def round_kernel(g: FlatGraph, order: np.ndarray, choice: np.ndarray, trial: np.ndarray) -> bool:
    """`_round` compiled, on `g`."""
    return _jit(_round)(
        order, choice, trial, g.adj_ptr, g.adj, g.src, g.dst, g.at, g.step, g.stride, g.flat,
        g.cost, g.size,
    )  # fmt: skip


def refine_kernel(g: FlatGraph, free: np.ndarray, choice: np.ndarray, sweeps: int) -> None:
    """`_refine` compiled, on `g` (in place on `choice`)."""
    _jit(_refine)(
        free, choice, sweeps, g.adj_ptr, g.adj, g.dst, g.at, g.step, g.stride, g.flat, g.cost,
        g.size,
    )  # fmt: skip


def minplus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``c[i, k] = min_j a[i, j] + b[j, k]`` (`_minplus`, compiled; the operands in
    row-major order, a transposed view copied once)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    _jit(_minplus)(a, b, out)
    return out


def warm() -> None:
    """Load (or compile) every kernel now."""
    g = flat_graph([np.zeros(2), np.zeros(2)], {(0, 1): np.eye(2)})
    c = np.zeros(2, np.int64)
    round_kernel(g, np.arange(2), c, c.copy())
    refine_kernel(g, np.ones(2, np.bool_), c, 1)
    minplus(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32))


def _minplus(a, b, out):
    """`minplus` into `out`: row by row, the first middle index's sums, then each later
    one's where smaller (each sum one rounding, the minimum exact)."""
    n, m = a.shape
    p = b.shape[1]
    for i in range(n):
        for k in range(p):
            out[i, k] = a[i, 0] + b[0, k]
        for j in range(1, m):
            aij = a[i, j]
            for k in range(p):
                t = aij + b[j, k]
                if t < out[i, k]:
                    out[i, k] = t


def _refine(free, choice, sweeps, adj_ptr, adj, dst, at, step, stride, flat, cost, size):
    """Iterated conditional modes (`search.engines.refine`): up to `sweeps` rounds in
    which each `free` node, in order, moves to its cheapest strategy given all its
    neighbours' (its cost plus, edge by edge, the rows of its edges at theirs), when
    that is cheaper than its own by more than 1e-15."""
    width = cost.shape[1]
    total = np.empty(width)
    for _ in range(sweeps):
        changed = False
        for v in range(len(size)):
            if not free[v]:
                continue
            s_v = size[v]
            for i in range(s_v):
                total[i] = 0.0
            for a in range(adj_ptr[v], adj_ptr[v + 1]):
                d = adj[a]
                col = at[d] + choice[dst[d]] * step[d]
                for i in range(s_v):
                    total[i] += flat[col + i * stride[d]]
            best = 0
            low = cost[v, 0] + total[0]
            for i in range(1, s_v):
                score = cost[v, i] + total[i]
                if score < low:
                    best, low = i, score
            if low < cost[v, choice[v]] + total[choice[v]] - 1e-15:
                choice[v] = best
                changed = True
        if not changed:
            break


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
    gain = np.empty(cost.shape[1])
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
        # gain[j] = min_i m[i, j] + held[x, i], read along the matrix's rows
        if step[d] == 1:  # row i of m is contiguous
            for j in range(size[u]):
                gain[j] = np.inf
            for i in range(size[x]):
                row = at[d] + i * stride[d]
                h = held[x, i]
                for j in range(size[u]):
                    c = flat[row + j] + h
                    if c < gain[j]:
                        gain[j] = c
        else:  # column j is
            for j in range(size[u]):
                col = at[d] + j * step[d]
                best = np.inf
                for i in range(size[x]):
                    c = flat[col + i] + held[x, i]
                    if c < best:
                        best = c
                gain[j] = best
        for j in range(size[u]):
            held[u, j] += gain[j]
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
