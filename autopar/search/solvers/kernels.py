"""The search's node-by-node loops, compiled by `numba` (`solvers._compiled`), over a
cost graph flattened into arrays (`FlatGraph`): a forest-descent round
(`solvers.forest`), iterated conditional modes (`search.engines.refine`), D-Rec's
passes (`search.engines._recursive`) and graph elimination's min-plus products.

These loops walk nodes and edges one at a time (a layer's chain of ops eliminates one
node at a time; a refinement visits every node in order), which Python does slowly
and numpy's array operations batch poorly (~2-3 us of fixed cost each). Compiled, each
keeps the arithmetic of the Python it replaced, in the same order (each sum one
rounding, minima exact, the first minimum kept), so plans are the same to the last bit
(`tests/test_kernels.py` keeps the Python as the reference).

numba is imported on first use, not with autopar. The functions are compiled once per
installation into numba's disk cache (next to `_compiled.py`, or the user's cache
directory where that one is not writable; ~5 s) and loaded once per process (~0.3 s,
`warm`; the planner loads them before it forks search workers, `search.workers`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = [
    "FlatGraph",
    "drec_kernel",
    "flat_graph",
    "minplus",
    "refine_kernel",
    "round_kernel",
    "warm",
]


@dataclass(frozen=True, eq=False)
class FlatGraph:
    """A cost graph (node costs, edge matrices) as arrays.

    Each edge ``e`` is kept both ways: directed edge ``d = 2e`` runs from its first node
    to its second, ``d = 2e + 1`` back (``d ^ 1`` is the other way), each with its own
    row-major matrix: entry ``[i, j]`` (``i`` a strategy of the node it leaves, ``j``
    of ``dst[d]``) is ``flat[at[d] + i * size[dst[d]] + j]``. So every loop reads along
    rows: a fold into ``dst[d]`` reads the rows of ``d``, and a node's costs at its
    neighbour's strategy are a row of the edge back (``d ^ 1``). Matrices equal in
    value are stored once (repeated layers give equal matrices, shared or not). Node
    costs are rows of ``cost`` (``[n, width]``, padded with inf); a node's directed
    edges are ``adj[adj_ptr[v]:adj_ptr[v + 1]]``, in the edges' order. ``nodes``/
    ``node_off`` hold the node costs flattened, and ``edge_*`` each undirected edge's
    nodes, offset and row width (for pricing)."""

    size: np.ndarray
    nodes: np.ndarray
    node_off: np.ndarray
    cost: np.ndarray
    flat: np.ndarray
    dst: np.ndarray
    at: np.ndarray
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
    keys, mats = list(edges.keys()), list(edges.values())
    if any(u == v for u, v in keys):
        raise ValueError("a cost graph's edge joins two distinct nodes")
    e = len(keys)
    # each matrix object once (repeated layers share them), then each distinct value
    # once: its entries and its transpose's are stored, at offsets both ways
    index_of: dict[int, int] = {}  # a matrix object -> its number among `distinct`
    distinct: list[np.ndarray] = []
    which = []
    for m in mats:
        i = index_of.get(id(m))
        if i is None:
            i = index_of[id(m)] = len(distinct)
            distinct.append(m)
        which.append(i)
    chunks: list[np.ndarray] = []
    by_value: dict[tuple, list] = {}  # (shape, hash of bytes) -> [(matrix, offsets)]
    offsets = np.empty((len(distinct), 2), np.int64)
    widths = np.empty(len(distinct), np.int64)
    stored = 0

    def store(m: np.ndarray) -> int:
        nonlocal stored
        chunks.append(m.ravel())
        stored += m.size
        return stored - m.size

    for i, m in enumerate(distinct):
        m = np.ascontiguousarray(m, dtype=np.float64)
        same = by_value.setdefault((m.shape, hash(m.tobytes())), [])
        got = next((o for held, o in same if np.array_equal(held, m)), None)
        if got is None:
            got = (store(m), store(np.ascontiguousarray(m.T)))
            same.append((m, got))
        offsets[i] = got
        widths[i] = m.shape[1]
    which = np.array(which, dtype=np.int64)
    at = offsets[which].ravel()
    flat = np.concatenate(chunks) if chunks else np.zeros(0)
    pair = np.array(keys, dtype=np.int64).reshape(e, 2)
    u, v = pair[:, 0].copy(), pair[:, 1].copy()
    width = widths[which]
    src, dst = np.empty(2 * e, np.int64), np.empty(2 * e, np.int64)
    src[0::2], src[1::2], dst[0::2], dst[1::2] = u, v, v, u
    adj = np.argsort(src, kind="stable").astype(np.int64)  # by node, in the edges' order
    adj_ptr = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=n))]).astype(np.int64)
    return FlatGraph(
        size, nodes, node_off, padded, flat, dst, at, adj, adj_ptr, u, v, at[0::2].copy(), width,
    )  # fmt: skip


def _loops():
    """The compiled loops (`solvers._compiled`), imported (numba with them) on first use."""
    from autopar.search.solvers import _compiled

    return _compiled


def round_kernel(g: FlatGraph, order: np.ndarray, choice: np.ndarray, trial: np.ndarray) -> bool:
    """One forest-descent round (`forest.forest_descent`) on `g`, into `trial`; False if
    the nodes taken hold a cycle."""
    return _loops().round_forest(
        order, choice, trial, g.adj_ptr, g.adj, g.dst, g.at, g.flat, g.cost, g.size
    )  # fmt: skip


def refine_kernel(g: FlatGraph, free: np.ndarray, choice: np.ndarray, sweeps: int) -> None:
    """`engines.refine`'s sweeps on `g` (in place on `choice`)."""
    _loops().refine(
        free, choice, sweeps, g.adj_ptr, g.adj, g.dst, g.at, g.flat, g.cost, g.size
    )  # fmt: skip


@dataclass(frozen=True, eq=False)
class DRecTables:
    """What one D-Rec pass reads besides the graph (`search.engines._drec_static`).

    Per node: its strategy table ``table[v]``, penalty kind ``kind[v]``, whether it is
    heavy (decided in ``order``), fixed, or too small to cut (``small``). Candidates of
    a node of table ``t`` with strategy ``c`` on axis ``ai`` (``f`` = 1 when small):
    ``cand[ptr[k]:ptr[k + 1]]`` for ``k = base[t] + (ai * S + c) * 2 + f``, ``S`` its
    table's size. Penalty of strategy ``i`` on axis ``ai`` for kind ``q``:
    ``pen[pen_base[q] + ai * S + i]``."""

    order: np.ndarray
    heavy: np.ndarray
    fixed: np.ndarray
    small: np.ndarray
    table: np.ndarray
    kind: np.ndarray
    base: np.ndarray
    ptr: np.ndarray
    cand: np.ndarray
    pen: np.ndarray
    pen_base: np.ndarray
    margin: float = 0.0


def drec_kernel(g: FlatGraph, d: DRecTables, axes: np.ndarray, choice: np.ndarray) -> None:
    """D-Rec's passes (`engines._recursive`) on `g` (in place on `choice`)."""
    _loops().drec(
        axes, d.order, d.heavy, d.fixed, d.small, d.table, d.kind, d.base, d.ptr, d.cand,
        d.pen, d.pen_base, d.margin, choice, g.adj_ptr, g.adj, g.dst, g.at, g.flat, g.cost, g.size,
    )  # fmt: skip


def minplus(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``c[i, k] = min_j a[i, j] + b[j, k]`` (the operands in row-major order, a
    transposed view copied once)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    _loops().minplus(a, b, out)
    return out


def warm() -> None:
    """Load (or compile) every kernel now."""
    g = flat_graph([np.zeros(2), np.zeros(2)], {(0, 1): np.eye(2)})
    c = np.zeros(2, np.int64)
    round_kernel(g, np.arange(2), c, c.copy())
    refine_kernel(g, np.ones(2, np.bool_), c, 1)
    minplus(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32))
    i, b = np.zeros(2, np.int64), np.zeros(2, np.bool_)
    ptr = np.array([0, 1, 2, 3, 4], np.int64)
    tables = DRecTables(i, b, b, b, i, i, i[:1], ptr, np.array([0, 0, 1, 1], np.int64),
                        np.zeros(2), i[:1])  # fmt: skip
    drec_kernel(g, tables, np.zeros(1, np.int64), c)
    one = np.ones(1, np.int64)
    combiner_runs(i, i[:1], np.zeros((1, 1), np.uint64), 0, 0, i[:1], i[:1], i[:1], one, 1, 1, 1)


def combiner_runs(
    ptr: np.ndarray,
    preds: np.ndarray,
    at: np.ndarray,
    first: int,
    last: int,
    order: np.ndarray,
    run: np.ndarray,
    prod: np.ndarray,
    size: np.ndarray,
    max_bytes: int,
    max_count: int,
    runs: int,
) -> np.ndarray:
    """How many times each run of all-reduces closes (`combiner.combined_latency`; the
    loop, `solvers._compiled.combiner_runs`, says what each argument holds)."""
    return _loops().combiner_runs(
        ptr, preds, at, first, last, order, run, prod, size, max_bytes, max_count, runs
    )
