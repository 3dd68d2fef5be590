"""The cost graph's edges: what resharding a value between its producer's and its
consumer's strategies costs, with all-reduces priced by bucket where XLA's combiner
will merge them (docs/algorithms.md, "Bucketed latency").

A gradient's all-reduce in data parallelism is independent of every other one, so
XLA merges them into a few buckets that pay the link latency once each. Charging each
its own latency, as a pairwise price otherwise would, makes data parallelism look
several latencies dearer than it compiles to on models with many small weights. The
engines (DP, ILP, recursive) need prices on edges, one pair at a time, so the bucket
is linearized: an all-reduce of a value that can join a bucket pays its bytes and a
share of one latency, the larger of its bytes over the bucket size and one over the
number of values that can join. The final price (`combiner.combined_latency`) then
simulates the combiner's pass over the compiled program (its runs follow XLA's
post-order walk), which the linear share approximates.
"""

from __future__ import annotations

import numpy as np

from autopar.cost.model import COMBINE_THRESHOLD_COUNT, CostModel
from autopar.cost.tables import reshard_table
from autopar.ir.graph import OTHER, Graph, TensorType
from autopar.ir.ops import CONTRACTIONS
from autopar.sharding import Spec
from autopar.strategies import Strategy


def combinable_values(graph: Graph) -> frozenset[int]:
    """`_combinable_values`, once per graph."""
    return graph.memo(_combinable_values)


def _combinable_values(graph: Graph) -> frozenset[int]:
    """Values no contraction depends on: what is left of the step after its last
    matmul (weight gradients, the optimizer's arithmetic on them, the loss). Their
    all-reduces have no collective of their own kind downstream to wait for, so the
    combiner can merge them: they form one antichain of the all-reduce order. A loop or
    a cond counts as a contraction (its body may hold one)."""
    feeds: set[int] = set()
    for node in reversed(graph.nodes):
        heavy = node.op in CONTRACTIONS or node.body is not None or node.branches is not None
        if heavy or any(v in feeds for v in node.outputs):
            feeds.update(node.inputs)
    return frozenset(v for v in range(len(graph.values)) if v not in feeds)


def bucket_share(
    graph: Graph,
    strategies: tuple[tuple[Strategy, ...], ...],
    combinable: frozenset[int],
    after: frozenset[int],
) -> float:
    """One over the number of combinable values some strategy makes a Partial sum of
    unsummed operands (where sums start: a weight gradient's matmul, not the ops that
    carry its sum on; not those in `after`, `chained` behind another sum), at most the
    combiner's operand count: the all-reduces that can share a bucket."""
    n_in = len(graph.inputs)
    k = sum(
        1
        for node in graph.nodes
        if node.id not in after
        for i, v in enumerate(node.outputs)
        if v in combinable and any(starts_sum(s, i) for s in strategies[n_in + node.id])
    )
    return 1.0 / max(1, min(k, COMBINE_THRESHOLD_COUNT))


def starts_sum(s: Strategy, k: int) -> bool:
    """Whether strategy `s` makes its output `k` a Partial sum of unsummed operands (a
    weight gradient's matmul), rather than carrying on a sum begun upstream."""
    return bool(s.out_specs[k].partial) and not any(sp.partial for sp in s.in_specs)


def chained(graph: Graph, strategies, combinable: frozenset[int]) -> frozenset[int]:
    """Graph nodes where a gradient's sum has already been taken: downstream of an op
    that can start a sum of a combinable value (a weight gradient's matmul) through an
    op that cannot carry a Partial sum on (a square, a root), so any sum at or after it
    is a second one (an optimizer's statistics of the summed gradient: Adafactor's row
    and column means, a clipping norm). Only the optimizer's ops (neither forward nor
    backward, `ir.graph.phases`) are such nodes, reached through combinable values: in
    the backward pass a sum after another need not follow an all-reduce, as the plan
    may have summed nothing upstream. XLA's combiner, walking the program in
    post-order where the optimizer's per-parameter chains interleave, closes a bucket at
    the first all-reduce that depends on one in it: such all-reduces are not merged and
    pay their own latency (docs/algorithms.md, "Bucketed latency")."""
    n_in = len(graph.inputs)
    phase = graph.phase
    made = {v: node.id for node in graph.nodes for v in node.outputs}
    below: set[int] = set()  # downstream of a possible start, through carriers at most
    after: set[int] = set()
    # per strategy table (repeated layers share theirs): whether each output can start
    # a sum, and whether any strategy carries one on
    facts: dict[tuple[int, int], tuple[tuple[bool, ...], bool]] = {}
    for node in graph.nodes:
        strats = strategies[n_in + node.id]
        key = (id(strats), len(node.outputs))
        if key not in facts:
            facts[key] = (
                tuple(any(starts_sum(s, k) for s in strats) for k in range(len(node.outputs))),
                any(
                    any(sp.partial for sp in s.in_specs) and any(o.partial for o in s.out_specs)
                    for s in strats
                ),
            )
        can_start, carries = facts[key]
        ups = {made[x] for x in node.inputs if x in made and x in combinable}
        starts = any(v in combinable and can_start[k] for k, v in enumerate(node.outputs))
        if phase[node.id] == OTHER and (ups & after or (ups & below and not carries)):
            after.add(node.id)
        elif starts or ups & below:
            below.add(node.id)
    return frozenset(after)


def reshard_seconds(cost: CostModel, t: TensorType, a: Spec, b: Spec, share: float | None) -> float:
    """Seconds to reshard `t` from `a` to `b`; with a `share` (the value can join the
    combiner's buckets) its all-reduces are priced by bucket."""
    r = cost.reshard(t, a, b)
    if share is None:
        return r.seconds
    return sum(cost.bucketed(c, share) for c in r.collectives)


def build_edges(
    graph, cost, strategies, source, share: float, combinable: frozenset[int], after: frozenset[int]
):
    """The cost graph's edges; `after` are the `chained` nodes, whose sums pay a whole
    latency."""
    n_in = len(graph.inputs)
    edges: dict[tuple[int, int], np.ndarray] = {}
    cache: dict = {}
    # repeated layers share strategy tables: a matrix per (tables, positions, type)
    # is made once, without collecting and hashing their specs again
    same: dict = {}
    uses: dict[int, int] = {}
    for node in graph.nodes:
        for x in node.inputs:
            uses[x] = uses.get(x, 0) + 1
    for node in graph.nodes:
        v_cg = n_in + node.id
        for j, x in enumerate(node.inputs):
            if x not in source:
                continue  # constants: any slice is free
            u, k = source[x]
            t = graph.values[x]
            s = share if x in combinable else None
            late = s is not None and u - n_in in after  # sums there pay a latency each
            key = (id(strategies[u]), k, id(strategies[v_cg]), j, t, uses[x], s, late)
            m = same.get(key)
            if m is None:
                src = tuple(st.out_specs[k] for st in strategies[u])
                dst = tuple(st.in_specs[j] for st in strategies[v_cg])
                m = reshard_matrix(cost, t, src, dst, cache, uses[x], s)
                rows = [r for r, st in enumerate(strategies[u]) if late and st.out_specs[k].partial]
                if rows:
                    m = m.copy()
                    m[rows] = reshard_matrix(cost, t, src, dst, cache, uses[x])[rows]
                same[key] = m
            add_edge(edges, u, v_cg, m)
    return edges


def add_edge(edges, u, v, mat):
    if u > v:
        u, v, mat = v, u, mat.T
    if not mat.any():
        edges.setdefault((u, v), np.zeros_like(mat))
        return
    if (u, v) in edges:
        edges[(u, v)] = edges[(u, v)] + mat
    else:
        edges[(u, v)] = mat


def reshard_matrix(
    cost: CostModel,
    t: TensorType,
    src: tuple[Spec, ...],
    dst: tuple[Spec, ...],
    cache,
    uses: int = 1,
    share: float | None = None,
) -> np.ndarray:
    """[len(src), len(dst)] resharding seconds, priced table-wise (`autopar.cost.tables`;
    equal to `reshard_seconds` pair by pair). A Partial value with `uses` uses is
    summed once, where it is produced (`evaluate.settle_partials`), not once per use:
    each use may instead pay its share of one all-reduce and reshard from the sum."""
    key = (t, src, dst, uses, share)
    m = cache.get(key)
    if m is not None:
        return m
    m = reshard_table(cost, src, dst, cache).seconds(t.nbytes, share).reshape(len(src), len(dst))
    rows = [i for i, a in enumerate(src) if a.partial]
    cols = [j for j, b in enumerate(dst) if not b.partial]
    if uses > 1 and rows and cols:
        whole = tuple(src[i].without_partial() for i in rows)
        summed = reshard_table(cost, tuple(src[i] for i in rows), whole, cache, cross=False)
        onward = reshard_table(cost, whole, tuple(dst[j] for j in cols), cache)
        once = summed.seconds(t.nbytes, share)[:, None] / uses + onward.seconds(t.nbytes).reshape(
            len(rows), len(cols)
        )
        at = np.ix_(rows, cols)
        m[at] = np.minimum(m[at], once)
    m.setflags(write=False)
    cache[key] = m
    return m
