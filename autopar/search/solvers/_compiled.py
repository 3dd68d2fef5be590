"""The search's node-by-node loops (`solvers.kernels` documents them and calls them):
imported on first use, so that `import autopar` does not import numba."""

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)
# A row of an edge's matrix is read through a view of `flat` from its first entry
# (`flat[start:]`, then `row[i]`): indexed as `flat[start + i]`, numba's handling of
# negative indices made every load a gather (start's sign is unknown). On the 7B
# step's 3-axis quotient a forest round took 4.75 -> 2.78 ms (its min-plus folds, 7.2 M
# entries, ~1.7 -> ~3.6 G entries/s), the same plans.
# `_MIN`: a running minimum kept in an array is written `x[k] = np.minimum(x[k], t)`, not
# `if t < x[k]: x[k] = t` nor `x[k] = t if t < x[k] else x[k]`: LLVM vectorizes the
# latter two with masked stores (`vmaskmovps`), microcoded and slow on AMD Zen, where the
# min-plus loops then ran at ~1.7 G entries/s; `np.minimum` stores every lane (a compare
# and blend), ~8 G/s in float32 and ~4 G/s in float64 there. The same minimum for every
# value the search makes (costs are never NaN; `np.minimum` would keep a NaN, the select
# dropped it).


@_jit
def drec(axes, order, heavy, fixed, small, table, kind, base, ptr, cand, pen, pen_base,
          margin, choice, adj_ptr, adj, dst, at, flat, cost, size):  # fmt: skip
    """D-Rec's passes (`search.engines._recursive`), one per axis in `axes`: the heavy
    nodes in `order`, each not yet decided taking its cheapest candidate (own time plus
    penalty, plus its edges' rows at its decided neighbours' strategies, the first
    minimum), each decision flooding breadth-first through the light nodes around it;
    then a flood from every decided node, in order; then each node still undecided,
    with its flood. A flood leaves a node too small to cut (`small`) undecided while
    its decided neighbours do not settle it (`_decide`), for a later flood or the last
    loop."""
    n = len(size)
    decided = np.empty(n, np.bool_)
    queue = np.empty(2 * n, np.int64)
    total = np.empty(cost.shape[1])
    # what a decision reads: the tables (`kernels.DRecTables`) and the graph
    ctx = (table, kind, small, base, ptr, cand, pen, pen_base, adj_ptr, adj, dst, at, flat,
           cost, size, margin)  # fmt: skip
    for ai in axes:
        decided[:] = fixed
        for v in order:
            _settle(v, ai, decided, heavy, choice, queue, total, ctx)
        k = 0
        for v in range(n):
            if decided[v]:
                queue[k] = v
                k += 1
        _flood(queue, k, ai, decided, heavy, choice, total, ctx)
        for v in range(n):
            if not decided[v]:
                _settle(v, ai, decided, heavy, choice, queue, total, ctx)


@_jit
def _settle(v, ai, decided, heavy, choice, queue, total, ctx):
    """Node `v` decided (if it is not yet), then the flood from it."""
    if not decided[v]:
        _decide(v, ai, decided, choice, total, ctx, False)
    queue[0] = v
    _flood(queue, 1, ai, decided, heavy, choice, total, ctx)


@_jit
def _flood(queue, tail, ai, decided, heavy, choice, total, ctx):
    """Breadth-first from `queue[:tail]`: each undecided light neighbour is decided and
    queued."""
    adj_ptr, adj, dst = ctx[8], ctx[9], ctx[10]
    head = 0
    while head < tail:
        u = queue[head]
        head += 1
        for a in range(adj_ptr[u], adj_ptr[u + 1]):
            w = dst[adj[a]]
            if (
                not decided[w]
                and not heavy[w]
                and _decide(w, ai, decided, choice, total, ctx, True)
            ):
                queue[tail] = w
                tail += 1


@_jit
def _decide(v, ai, decided, choice, total, ctx, defer):
    """Node `v` takes its cheapest candidate on axis `ai` and is decided (True). A node
    too small to cut (`small`) takes its cheapest candidate that leaves the axis whole,
    unless another is cheaper by more than `margin` (the latency a collective costs at
    least): only where cutting it spares a collective with its decided neighbours. With
    `defer`, such a node whose two choices are within `margin` (its decided neighbours
    do not settle it: a rotary embedding's product with a whole cosine table, its other
    operand undecided) is left undecided (False)."""
    table, kind, small, base, ptr, cand, pen, pen_base = ctx[:8]
    adj_ptr, adj, dst, at, flat, cost, size, margin = ctx[8:]
    s_v = size[v]
    for i in range(s_v):
        total[i] = 0.0
    for a in range(adj_ptr[v], adj_ptr[v + 1]):
        d = adj[a]
        u = dst[d]
        if decided[u]:
            row = flat[at[d ^ 1] + choice[u] * s_v :]  # a view: contiguous loads (_row)
            for i in range(s_v):
                total[i] += row[i]
    k = base[table[v]] + (ai * s_v + choice[v]) * 2
    p = pen_base[kind[v]] + ai * s_v
    best, low = _cheapest(ptr[k + 1 if small[v] else k], ptr[k + 2 if small[v] else k + 1],
                          cand, cost[v], pen, p, total)  # fmt: skip
    if small[v]:
        other, score = _cheapest(ptr[k], ptr[k + 1], cand, cost[v], pen, p, total)
        if score < low - margin:
            best = other
        elif defer and other != best and score < low + margin:
            return False
    choice[v] = best
    decided[v] = True
    return True


@_jit
def _cheapest(lo, hi, cand, cost, pen, p, total):
    """(the first candidate of `cand[lo:hi]` with the least own time plus penalty plus
    edges, that score)."""
    best, low = -1, 0.0
    for j in range(lo, hi):
        i = cand[j]
        score = cost[i] + pen[p + i] + total[i]
        if best < 0 or score < low:
            best, low = i, score
    return best, low


@_jit
def minplus(a, b, out):
    """`kernels.minplus` into `out`: row by row, the first middle index's sums, then each later
    one's where smaller (each sum one rounding, the minimum exact)."""
    n, m = a.shape
    p = b.shape[1]
    for i in range(n):
        for k in range(p):
            out[i, k] = a[i, 0] + b[0, k]
        for j in range(1, m):
            aij = a[i, j]
            for k in range(p):
                out[i, k] = np.minimum(out[i, k], aij + b[j, k])  # (`_MIN`)


@_jit
def refine(free, choice, sweeps, adj_ptr, adj, dst, at, flat, cost, size):
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
                row = flat[at[d ^ 1] + choice[dst[d]] * s_v :]
                for i in range(s_v):
                    total[i] += row[i]
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


@_jit
def round_forest(order, choice, trial, adj_ptr, adj, dst, at, flat, cost, size):
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
                row = flat[at[d ^ 1] + choice[y] * size[x] :]
                for i in range(size[x]):
                    held[x, i] += row[i]
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
        # gain[j] = min_i m[i, j] + held[x, i], read along the rows of m
        for j in range(size[u]):
            gain[j] = np.inf
        for i in range(size[x]):
            row = flat[at[d] + i * size[u] :]
            h = held[x, i]
            for j in range(size[u]):
                gain[j] = np.minimum(gain[j], row[j] + h)  # (`_MIN`)
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
            row = at[d ^ 1] + trial[dst[d]] * size[x]
            best = flat[row] + held[x, 0]
            for i in range(1, size[x]):
                c = flat[row + i] + held[x, i]
                if c < best:
                    best, pick = c, i
        trial[x] = pick
    return True


@_jit
def combiner_runs(ptr, preds, at, first, last, order, run, prod, size, max_bytes, max_count,
                  runs):  # fmt: skip
    """`combiner.combined_latency`'s runs: how many times each run of all-reduces closes.

    `at[v]`: the all-reduces node v reads, as bits (one per all-reduce, in uint64
    words); in place, for v in first..last, OR'ed with its producers' rows (`ptr`,
    `preds`: CSR), so that `at[u]` holds the all-reduces upstream of u. Then the
    all-reduces in `order` (the walk's), each joining its run `run[i]` (kind, device
    group), which closes first when it is full (`max_bytes`, `max_count`) or holds one
    the new one depends on (upstream of its producer `prod[i]`)."""
    w = at.shape[1]
    for v in range(first, last + 1):
        for a in range(ptr[v], ptr[v + 1]):
            u = preds[a]
            for k in range(w):
                at[v, k] |= at[u, k]
    total = np.zeros(runs, np.int64)
    count = np.zeros(runs, np.int64)
    closed = np.zeros(runs, np.int64)
    members = np.zeros((runs, w), np.uint64)
    for i in order:
        r = run[i]
        if count[r]:
            upstream = False
            for k in range(w):
                if at[prod[i], k] & members[r, k]:
                    upstream = True
            if total[r] + size[i] > max_bytes or count[r] == max_count or upstream:
                closed[r] += 1
                total[r] = 0
                count[r] = 0
                members[r, :] = 0
        total[r] += size[i]
        count[r] += 1
        members[r, i >> 6] |= np.uint64(1) << np.uint64(i & 63)
    return closed
