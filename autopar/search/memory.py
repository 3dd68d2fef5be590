"""A plan's peak memory per device (`peak_memory`), the walk `evaluate` prices.

Every engine's plan, each polish and each screened mesh shape is priced, so the walk
runs tens of times per `.plan()` over graphs of 10k+ ops. Its plan-independent part is
done once per graph (`_GraphWalk`: the ops' operands and results as flat arrays, shared
by a mesh search's shapes) and once per problem (`_Walk`: each strategy table's specs
as small integers, equal specs equal ids), so that a plan's walk is a few gathers and
scatters over those arrays. The sums are made in the order
the op-by-op walk made them (`np.add.at` adds in index order), so the result is the
same to the byte."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from autopar.cost.model import FUSED_OPS
from autopar.ir.graph import Graph
from autopar.search.build import Problem
from autopar.sharding import Spec

_WALKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _GraphWalk:
    """What `peak_memory` reads of a graph, for every problem of it (the shapes of a
    mesh-shape search share it): each operand read ("edge": op, position, value) and
    result made (op, position, value) as flat arrays, each value's bytes and rank, and
    the values a plan may fuse away (`cand_v`, from `_fusable`; `f_*`: one row per
    position read)."""

    def __init__(self, g: Graph):
        nodes = g.nodes
        n_ops = self.n_ops = len(nodes)
        e_op, e_j, e_x = [], [], []
        m_op, m_k, m_v = [], [], []
        for node in nodes:
            for j, x in enumerate(node.inputs):
                e_op.append(node.id)
                e_j.append(j)
                e_x.append(x)
            for k, v in enumerate(node.outputs):
                m_op.append(node.id)
                m_k.append(k)
                m_v.append(v)
        self.e_op, self.e_j, self.e_x = (np.array(a, np.int64) for a in (e_op, e_j, e_x))
        self.m_op, self.m_k, self.m_v = (np.array(a, np.int64) for a in (m_op, m_k, m_v))
        self.producer = np.full(len(g.values), -1, np.int64)
        self.producer[self.m_v] = self.m_op
        self.inputs = np.array(g.inputs, np.int64)
        self.outputs = np.array(g.outputs, np.int64)
        self.nbytes = np.array([t.nbytes for t in g.values], np.int64)
        self.scalar = np.array([not t.rank for t in g.values], bool)
        f_v, f_edge, f_group, cand = [], [], [], []
        first = np.searchsorted(self.e_op, np.arange(n_ops)).tolist()  # each op's first edge
        for v, c, positions in g.memo(_fusable):
            for j in positions:
                f_v.append(v)
                f_edge.append(first[c] + j)
                f_group.append(len(cand))
            cand.append(v)
        self.f_v, self.f_edge = np.array(f_v, np.int64), np.array(f_edge, np.int64)
        self.f_group, self.cand_v = np.array(f_group, np.int64), np.array(cand, np.int64)
        self.op_inputs = [np.array(n.inputs, np.int64) for n in nodes]


def _fusable(g: Graph) -> list[tuple[int, int, tuple[int, ...]]]:
    """(value, its reader, the reader's operand positions that read it) of every value a
    plan may keep inside one fused kernel: made by a FUSED_OPS op, read by one FUSED_OPS
    op alone, not returned (`peak_memory` drops those its plan reads in the layout they
    are made in)."""
    returned = set(g.outputs)
    fused = [n.op in FUSED_OPS for n in g.nodes]
    out = []
    for n in g.nodes:
        if not fused[n.id]:
            continue
        for v in n.outputs:
            readers = g.consumers.get(v, ())
            if v in returned or len(readers) != 1 or not fused[readers[0]]:
                continue
            c = readers[0]
            out.append((v, c, tuple(j for j, x in enumerate(g.nodes[c].inputs) if x == v)))
    return out


def fusable(g: Graph) -> frozenset[int]:
    """The values of `g` some plan may fuse away (`_fusable`; `evaluate.memory_floor`
    leaves them all out)."""
    return g.memo(_fusable_values)


def _fusable_values(g: Graph) -> frozenset[int]:
    return frozenset(v for v, _, _ in g.memo(_fusable))


class _Walk:
    """What `peak_memory` reads of `problem` whatever the plan, beside its graph's
    `_GraphWalk` (`g`).

    Each distinct strategy table (repeated layers share theirs) is laid out once in
    `ins` / `outs`: strategy s's operand j of a table with `a` operands at
    `base + s * a + j`, as a spec id (`id`: equal specs, equal ids; `shards` per id).
    Per operand read and per result made, where its table's entries start and how
    many there are per strategy; each op's span (itself, or its 1F1B region's), and
    per value the fraction of it resident at once (`Problem.resident`)."""

    def __init__(self, problem: Problem):
        g, n_in, strategies = problem.graph, problem.num_inputs, problem.strategies
        self.mesh = problem.cost.mesh
        self.ids: dict[Spec, int] = {}
        self.shards: list[int] = []
        ins, outs, partial = [], [], []
        in_at: dict[int, tuple[int, int]] = {}  # id(table) -> (base, operands)
        out_at: dict[int, tuple[int, int]] = {}
        in_base, in_ar = np.zeros(len(strategies), np.int64), np.zeros(len(strategies), np.int64)
        out_base, out_ar = np.zeros_like(in_base), np.zeros_like(in_base)
        for v, table in enumerate(strategies):
            key = id(table)
            if key not in in_at:
                a, b = len(table[0].in_specs), len(table[0].out_specs)
                in_at[key], out_at[key] = (len(ins), a), (len(outs), b)
                ins += [self.id(sp) for st in table for sp in st.in_specs]
                outs += [self.id(sp) for st in table for sp in st.out_specs]
                partial += [bool(sp.partial) for st in table for sp in st.out_specs]
            in_base[v], in_ar[v] = in_at[key]
            out_base[v], out_ar[v] = out_at[key]
        self.ins, self.outs = np.array(ins, np.int64), np.array(outs, np.int64)
        self.partial = np.array(partial, bool)
        self.in_base, self.in_ar, self.out_base, self.out_ar = in_base, in_ar, out_base, out_ar
        self.n_in = n_in
        # each op's span: itself, or its 1F1B region's first and last op
        n_ops = len(g.nodes)
        lo, hi = np.arange(n_ops), np.arange(n_ops)
        for region in problem.regions:
            idx = np.fromiter(region, np.int64)
            lo[idx], hi[idx] = idx.min(), idx.max()
        self.lo, self.hi = lo, hi
        self.g = gw = g.memo(_GraphWalk)
        # the operands a strategy gives a spec (all, but the walk has always zipped them)
        read = gw.e_j < in_ar[n_in + gw.e_op]
        self.e_op, self.e_x = gw.e_op[read], gw.e_x[read]
        self.e_at = in_base[n_in + self.e_op] + gw.e_j[read]
        self.e_ar = in_ar[n_in + self.e_op]
        self.f_edge = (np.cumsum(read) - 1)[gw.f_edge]  # fused values' reads are all read
        self.m_at = out_base[n_in + gw.m_op] + gw.m_k
        self.m_ar = out_ar[n_in + gw.m_op]
        self.resident = np.ones(len(g.values))
        for v, f in problem.resident.items():
            self.resident[v] = f
        self.donated_out = np.array(
            [problem.aliases.get(o, -1) in problem.donated for o in range(len(g.outputs))], bool
        )
        self.passed_out = np.isin(np.asarray(g.outputs, np.int64), np.asarray(g.inputs, np.int64))

    def id(self, spec: Spec) -> int:
        i = self.ids.get(spec)
        if i is None:
            i = self.ids[spec] = len(self.shards)
            self.shards.append(spec.shards(self.mesh))
        return i


def _walk(problem: Problem) -> _Walk:
    w = _WALKS.get(problem)
    if w is None:
        w = _WALKS[problem] = _Walk(problem)
    return w


def peak_memory(
    problem: Problem,
    choice: Sequence[int],
    settled: dict[int, Spec],
    targets: Sequence[Spec] | None = None,
) -> tuple[int, int]:
    """(peak, argument) bytes per device: arguments stay live throughout; each
    intermediate lives from its producer to its last consumer (outputs to the end),
    at the size of its settled spec (`settle_partials`; `settled`: its value -> spec
    map). An output returned in another layout than it is made in (`targets`, the
    specs the function returns: an updated parameter made split by a ZeRO update and
    returned in its argument's layout) holds that copy too at the end, unless the
    argument is donated (`Problem.donated`: then it is written into its buffer; a GPT
    step with `remat="full"` on data 8 was predicted at 704 MiB, its arguments and
    returned outputs alone 1061 MiB; XLA compiled 1157). A value fused away (below)
    takes no memory; its reads keep its own operands alive instead. An op that reads a value in another layout than it is stored in (an
    all-gathered weight, a loop's stacked weights gathered for the whole loop) holds
    that copy while it runs. A 1F1B region (`Problem.regions`) runs as one loop:
    everything its ops make is alive, and every copy they read held, from its first op
    to its last, as are the pipeline's own buffers (`Problem.buffers`).

    Fused away: values XLA never writes to memory, made by an elementwise or shape op
    (FUSED_OPS) for exactly one such op to read, in the layout it is made in, and not
    returned. They live inside one fused kernel; the compute model already prices them
    so (`facts.hbm_traffic`, which also counts values read by several fused ops as
    never written). Counting those here as well made the prediction fall 8-30% below
    XLA's for float32 GPT, ViT and Wide-ResNet steps; XLA materializes many of them."""
    w = _walk(problem)
    gw = w.g
    n_in, n_ops, n_values = w.n_in, gw.n_ops, len(gw.nbytes)
    c = np.asarray(choice, dtype=np.int64)
    args = int(sum(problem.node_mem[i][choice[i]] for i in range(n_in)))
    # each value's spec as stored: an argument's, or as its op makes it (a partial sum
    # in its settled spec); -1 for values neither holds (constants)
    rows = w.m_at + c[n_in + gw.m_op] * w.m_ar
    made = w.outs[rows]
    for i in np.flatnonzero(w.partial[rows]).tolist():
        sp = settled.get(int(gw.m_v[i]))
        if sp is not None:
            made[i] = w.id(sp)
    held = np.full(n_values, -1, np.int64)
    held[gw.inputs] = w.outs[w.out_base[:n_in] + c[:n_in] * w.out_ar[:n_in]]
    held[gw.m_v] = made
    want = w.ins[w.e_at + c[n_in + w.e_op] * w.e_ar]
    stored = held[w.e_x]
    copy = (stored >= 0) & (want != stored)
    # read as a copy, a value is needed only while the copy is made (a region's: at its
    # start); in its own layout, while the reader runs
    at = np.where(copy, w.lo[w.e_op], w.hi[w.e_op])
    # fused away: every read of a candidate in the layout it is made in
    bad = gw.f_group[want[w.f_edge] != held[gw.f_v]]
    ok = np.ones(len(gw.cand_v), bool)
    ok[bad] = False
    virtual = np.zeros(n_values, bool)
    virtual[gw.cand_v[ok]] = True
    # last uses: a read of a fused-away value keeps the values it was made from alive
    last = np.full(n_values, -1, np.int64)
    direct = ~virtual[w.e_x]
    np.maximum.at(last, w.e_x[direct], at[direct])
    push = np.full(n_values, -1, np.int64)
    np.maximum.at(push, w.e_x[~direct], at[~direct])
    fused = np.flatnonzero(virtual)
    for v in fused[np.argsort(-gw.producer[fused], kind="stable")].tolist():
        t = push[v]
        for x in gw.op_inputs[gw.producer[v]].tolist():
            if virtual[x]:
                push[x] = max(push[x], t)
            elif last[x] < t:
                last[x] = t
    last[gw.outputs] = n_ops
    # allocations, in the op-by-op walk's order: each op's copies, then its results
    xs, specs = w.e_x[copy], want[copy]
    starts = at[copy]
    key = (starts * n_values + xs) * (len(w.shards) + 1) + specs
    _, first = np.unique(key, return_index=True)  # one copy serves a whole region
    first.sort()
    shards = np.array(w.shards, np.int64)
    keep = ~virtual[gw.m_v]
    vs = gw.m_v[keep]
    ops = np.concatenate([w.e_op[copy][first], gw.m_op[keep]])
    values = np.concatenate([xs[first], vs])
    spec = np.concatenate([specs[first], held[vs]])
    size = np.where(gw.scalar[values], gw.nbytes[values], gw.nbytes[values] // shards[spec])
    b = size * w.resident[values]
    alloc = np.concatenate([starts[first], w.lo[gw.m_op[keep]]])
    read_until = np.maximum(np.where(last[vs] < 0, gw.m_op[keep], last[vs]), w.hi[gw.m_op[keep]])
    ends = np.concatenate([w.hi[w.e_op[copy][first]], read_until])
    results = np.r_[np.zeros(len(first), np.int64), np.ones(len(vs), np.int64)]
    order = np.argsort(ops * 2 + results, kind="stable")
    made_at = np.zeros(n_ops + 1)
    free_at = np.zeros(n_ops + 1)
    np.add.at(made_at, alloc[order], b[order])
    np.add.at(free_at, ends[order], b[order])
    for i, buffer in problem.buffers.items():  # a pipeline's own buffers, its whole region
        size = float(buffer[choice[n_in + i]])
        made_at[w.lo[i]] += size
        free_at[w.hi[i]] += size
    if n_ops:  # the returned copies, made at the end (an updated argument that is
        # donated is written into its buffer instead): of an output in another layout
        # than it is made in, and of an argument returned as it came (XLA copies it into
        # an output buffer of its own: a LoRA step's frozen weights, NNX writing back
        # every leaf)
        outs = gw.outputs
        tid = held[outs] if targets is None else np.array([w.id(t) for t in targets], np.int64)
        again = (held[outs] >= 0) & ((held[outs] != tid) | w.passed_out)
        again &= ~gw.scalar[outs] & ~w.donated_out
        size = gw.nbytes[outs] // np.array(w.shards, np.int64)[np.maximum(tid, 0)]
        made_at[n_ops - 1] += float(size[again].sum())
    live = np.cumsum(made_at) - np.concatenate(([0.0], np.cumsum(free_at)[:-1]))
    return int(args + max(0.0, float(live[:n_ops].max(initial=0.0)))), args
