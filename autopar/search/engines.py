"""Search engines over a `Problem`: D-Rec (`recursive`), greedy propagation
from pinned nodes (`propagate`, used by the baselines), and what the `data` and
`fsdp` recipes search (`data_problem`, `zero3_problem` and their pins). An engine
returns one strategy index per cost-graph node."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

import numpy as np

from autopar.ir.graph import BACKWARD, OTHER, Graph
from autopar.search.build import Problem
from autopar.search.edges import combinable_values
from autopar.search.evaluate import total_time
from autopar.search.layouts import optimizer_state_inputs
from autopar.search.solvers.forest import forest_descent
from autopar.search.solvers.kernels import DRecTables, drec_kernel, flat_graph, refine_kernel
from autopar.sharding import axis_order_slow_first

# MindSpore D-Rec weighs the cost of replicating a parameter (a batch cut) by
# 0.25 against replicating an activation: weights are reused across the batch.
PARAM_REPLICATION_WEIGHT = 0.25
# Order of decision in a D-Rec round: contractions, then reductions, then the rest.
_TIER = {
    "dot_general": 0,
    "conv_general_dilated": 0,
    "gather": 1,
    "scatter-add": 1,
    "reduce_sum": 2,
    "reduce_max": 2,
}


def neighbour_tables(problem: Problem) -> list[list[tuple[int, np.ndarray]]]:
    """Per node v: (neighbour u, matrix indexed [s_u, s_v]) for every edge touching v.
    The engines, the refine rounds and the polish of one search ask for the same
    problem's tables many times: the last few are kept (by the edge dict's identity,
    which a problem never changes)."""
    edges = problem.edges
    for held, nb in _NEIGHBOURS:
        if held is edges:
            return nb
    nb = [[] for _ in range(len(problem.strategies))]
    for (u, v), m in edges.items():
        nb[u].append((v, m.T))
        nb[v].append((u, m))
    _NEIGHBOURS.append((edges, nb))
    return nb


_NEIGHBOURS: deque = deque(maxlen=4)


def edge_sum(nb_v, choice, decided, size):
    """Sum over decided neighbours u of edge[s_u, :] -> a vector over v's strategies."""
    total = np.zeros(size)
    for u, m in nb_v:
        if decided[u]:
            total += m[choice[u]]
    return total


def propagate(
    problem: Problem,
    pinned: Mapping[int, int],
    seeds: Collection[int] | None = None,
    forward: bool = False,
) -> list[int]:
    """Sharding propagation: breadth-first from the pinned nodes (those in `seeds` only,
    when given; the other pins are decided but start nothing); every node reached takes
    the strategy that minimizes its own cost plus resharding against its neighbours
    decided so far. Nodes no seed reaches are decided last, in order. `forward`: first
    the ops a seed's split flows into, in program order, each after its producers (as
    the values flow when the step runs); an op none of whose producers holds a split
    value (a Partial sum is none) waits. Then the rest in reverse program order, each
    after its consumers: a value made from replicated ones alone (NNX's broadcast
    attention dropout mask, `[1, 1, T, T]`) takes the layout the split activations it
    meets read it in (decided from its producers, it took whatever split was cheapest
    to compute, over T, which the activations then had to gather); a Partial gradient's
    optimizer update the layout its parameter is written back in (from the gradient, a
    reduce-scatter and a split update, then gathered)."""
    n = len(problem.strategies)
    nb = neighbour_tables(problem)
    choice = [0] * n
    decided = np.zeros(n, bool)
    queue = deque()
    for v, s in sorted(pinned.items()):
        choice[v], decided[v] = s, True
        if seeds is None or v in seeds:
            queue.append(v)
    seen = decided.copy()

    def decide(v):
        score = problem.node_time[v] + edge_sum(nb[v], choice, decided, len(problem.strategies[v]))
        choice[v], decided[v] = int(np.argmin(score)), True

    if forward:  # edges join a producer to a later consumer (nodes are in program order)
        reached = np.zeros(n, bool)
        reached[list(queue)] = True
        for v in range(n):
            if not reached[v]:
                continue
            if not decided[v]:
                decide(v)
            held = problem.strategies[v][choice[v]].out_specs
            if any(any(spec.dims) for spec in held):
                for w, _ in nb[v]:
                    reached[w] |= w > v
        for v in reversed(range(n)):
            if not decided[v]:
                decide(v)
        return choice

    for start in [*range(n)]:
        if not queue:
            if seen[start]:
                continue
            seen[start] = True
            decide(start)
            queue.append(start)
        while queue:
            u = queue.popleft()
            for w, _ in nb[u]:
                if not seen[w]:
                    seen[w] = True
                    decide(w)
                    queue.append(w)
    return choice


def refine(
    problem: Problem, choice: list[int], pinned: Mapping[int, int], sweeps: int = 2
) -> list[int]:
    """Iterated conditional modes: each free node moves to its best strategy given
    all neighbours. Never increases the total cost. `choice` is updated in place
    (compiled: `solvers.kernels.refine_kernel`)."""
    g = flat_graph(problem.node_time, problem.edges)
    free = g.size > 1
    free[list(pinned)] = False
    moved = np.array(choice, dtype=np.int64)
    refine_kernel(g, free, moved, sweeps)
    choice[:] = moved.tolist()
    return choice


# recursive's plans per problem (weakly held) and pins: `auto` runs it as an engine and
# again as the start of dp's descent on the same problem
_RECURSIVE_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def recursive(problem: Problem, pinned: Mapping[int, int] = {}, sweeps: int = 8) -> list[int]:  # noqa: B006
    """`_recursive`, once per (problem, pins, sweeps)."""
    return recursive_plans(problem, pinned, sweeps)[0]


def recursive_plans(
    problem: Problem,
    pinned: Mapping[int, int] = {},  # noqa: B006
    sweeps: int = 8,
) -> tuple[list[int], list[int]]:
    """`recursive`'s plan, and its plan before the cone rounds (`_cones`): the engine
    hands that back as a runner-up, as the objective can rank them the other way from
    the final price (`search._recursive`)."""
    memo = _RECURSIVE_PLANS.setdefault(problem, {})
    key = (tuple(sorted(pinned.items())), sweeps)
    if key not in memo:
        first = _recursive(problem, pinned, sweeps)
        again = _optimizer_from_its_results(problem, list(first), pinned, sweeps)
        best = min((first, again), key=lambda c: total_time(problem, c))
        memo[key] = (tuple(_cones(problem, best, pinned)), tuple(best))
    return list(memo[key][0]), list(memo[key][1])


# `recursive`'s last polish: cone rounds of the forest descent (max rounds, patience)
CONES = (6, 2)


def _cones(problem: Problem, choice: list[int], pinned: Mapping[int, int]) -> list[int]:
    """`choice` after cone rounds of the forest descent (`solvers.forest`), the pins held.
    D-Rec's greedy flood and `refine`'s one-node moves leave chains that only move at
    once: on a GPT-2-style step (4 layers, width 64, 8 devices) a position embedding's
    update split by its gradient's scatter and gathered at its end, 2.1x the ILP; the
    cone rounds reach the optimum."""
    out, _ = forest_descent(
        problem.node_time, problem.edges, choice, *CONES, random=False, pinned=pinned
    )
    return out


def _optimizer_from_its_results(
    problem: Problem, choice: list[int], pinned: Mapping[int, int], sweeps: int
) -> list[int]:
    """`choice` with the optimizer's ops, its state and a gradient's last reshaping
    (backward, not a contraction, combinable) decided again, from the updated state back
    towards the gradient, each given the neighbours decided so far, then refined. D-Rec floods
    forward from each summed gradient into the optimizer: every op splits its share of
    the update (slicing a summed gradient is free, the compute drops) and the chain ends
    in an all-gather of the new parameter, which no single-op refinement undoes (the
    chain has cycles; ViT-L2: 1.154x the ILP). Deciding backward from the parameter,
    whose layout the forward pass fixed, keeps the update whole where that is cheaper."""
    g, n_in, n = problem.graph, problem.num_inputs, len(choice)
    phase, after, state = g.phase, combinable_values(g), optimizer_state_inputs(problem)

    def late(v: int) -> bool:
        if v in pinned or len(problem.strategies[v]) == 1:
            return False
        if v < n_in:  # the optimizer's state, decided last
            return v in state
        node = g.nodes[v - n_in]
        tail = phase[node.id] == BACKWARD and node.op not in _TIER
        return phase[node.id] == OTHER or (tail and all(x in after for x in node.outputs))

    redo = [late(v) for v in range(n)]
    if not any(redo):
        return choice
    nb = neighbour_tables(problem)
    decided = np.array([not r for r in redo])
    for v in reversed(range(n)):
        if redo[v]:
            size = len(problem.strategies[v])
            score = problem.node_time[v] + edge_sum(nb[v], choice, decided, size)
            choice[v], decided[v] = int(np.argmin(score)), True
    return refine(problem, choice, pinned, sweeps)


def _recursive(problem: Problem, pinned: Mapping[int, int], sweeps: int) -> list[int]:
    """MindSpore's double-recursive programming (D-Rec) on named mesh axes.

    Outer loop: one cut per mesh axis, slow (inter-node) axes first. A
    PartitionSpec cannot split one mesh axis over two dims, so an axis of size p is
    one p-way cut rather than log2(p) halvings. Inner pass: the heavy ops
    (contractions, gathers, reductions), heaviest first, each pick which of their
    factors the axis cuts, minimizing own cost (compute, plus D-Rec's penalty for
    inputs the cut leaves replicated and partial sums it creates) plus resharding
    against whatever is already decided this round. D-Rec removes elementwise ops
    and lets them copy a neighbour; here each decision floods breadth-first through
    the light ops around it, which then sit decided between the heavy ops, so the
    next heavy op sees its neighbours' cuts. Finally `refine` polishes the result,
    up to `sweeps` rounds (it stops when a round changes nothing; on ViT-B with 2 layers
    2 rounds left 10% on the table that rounds 3 to 8 recover).

    `recursive` then tries `_optimizer_from_its_results` on the plan and keeps the
    cheaper of the two.
    """
    return refine(problem, _drec_passes(problem, pinned), pinned, sweeps)


def _drec_passes(problem: Problem, pinned: Mapping[int, int]) -> list[int]:
    """`_recursive`'s passes, one per mesh axis, before its `refine` (compiled:
    `solvers.kernels.drec_kernel`)."""
    static = _drec_static(problem)
    choice = static.start.copy()  # every node whole, where its table allows
    fixed = static.single.copy()
    for v, s in pinned.items():
        choice[v], fixed[v] = s, True
    heavy = static.tiered & ~fixed
    order = sorted(np.flatnonzero(heavy).tolist(), key=static.rank.__getitem__)
    tables = replace(static.tables, order=np.array(order, dtype=np.int64), heavy=heavy, fixed=fixed)
    names = problem.mesh.axis_names
    axes = np.array([names.index(a) for a in axis_order_slow_first(problem.mesh)], dtype=np.int64)
    drec_kernel(flat_graph(problem.node_time, problem.edges), tables, axes, choice)
    return choice.tolist()


@dataclass(frozen=True, eq=False)
class _DRecStatic:
    """What D-Rec reads of a problem whatever the pins: the tables (`DRecTables`, its
    order, heavy and fixed nodes left empty), each node's first strategy (the one
    whose assignment is all None, else 0), which nodes have one strategy, which are
    heavy ops (`_TIER`) and their rank in the decision order."""

    tables: DRecTables
    start: np.ndarray
    single: np.ndarray
    tiered: np.ndarray
    rank: dict[int, tuple]


_DREC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # problem -> _DRecStatic


def _drec_static(problem: Problem) -> _DRecStatic:
    """`_DRecStatic` of `problem`, once per problem. Candidates (an axis's cut: the
    strategies that agree with the current one on every other axis; for a node too
    small to cut, those that leave the axis whole, if any) and penalties are tabled
    per strategy table and penalty kind, as the Python loop memoized them."""
    if problem in _DREC:
        return _DREC[problem]
    g, n_in = problem.graph, problem.num_inputs
    n, n_axes = len(problem.strategies), len(problem.mesh.axis_names)
    none = tuple([None] * n_axes)
    table_of: dict[int, int] = {}
    table, start = np.empty(n, np.int64), np.empty(n, np.int64)
    firsts, base, counts, cands, rows_so_far = [], [], [], [], 0
    for v, st in enumerate(problem.strategies):
        t = table_of.get(id(st))
        if t is None:
            t = table_of[id(st)] = len(firsts)
            firsts.append({s.assignment: i for i, s in enumerate(st)}.get(none, 0))
            count, cand = _candidates(st, n_axes)
            base.append(rows_so_far)
            rows_so_far += len(count)
            counts.append(count)
            cands.append(cand)
        table[v], start[v] = t, firsts[t]
    penalty = _replication_penalty(problem)
    kinds: dict = {}
    kind, pen_base, pens, pen_so_far = np.empty(n, np.int64), [], [], 0
    widest = max(len(st) for st in problem.strategies)
    for v in range(n):
        key = _penalty_kind(problem, v)
        if key not in kinds:
            kinds[key] = len(kinds)
            size = widest if v < n_in else len(problem.strategies[v])  # inputs: all 0
            pens.append(np.zeros(n_axes * size) if v < n_in else penalty(v).ravel())
            pen_base.append(pen_so_far)
            pen_so_far += len(pens[-1])
        kind[v] = kinds[key]
    ptr = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
    tiered = np.array([v >= n_in and g.nodes[v - n_in].op in _TIER for v in range(n)])
    # heavy ops too small to cut decide last, among their decided neighbours
    small = np.array(_latency_bound(problem))
    rank = {
        v: (bool(small[v]), _TIER[g.nodes[v - n_in].op], -problem.flops[v], v)
        for v in np.flatnonzero(tiered)
    }
    empty = np.zeros(0, np.int64)
    static = _DRecStatic(
        DRecTables(
            empty,
            empty.astype(bool),
            empty.astype(bool),
            small,
            table,
            kind,
            np.array(base, dtype=np.int64),
            ptr,
            np.concatenate(cands).astype(np.int64),
            np.concatenate(pens).astype(np.float64),
            np.array(pen_base, dtype=np.int64),
            _least_latency(problem),
        ),  # fmt: skip
        start,
        np.array([len(st) == 1 for st in problem.strategies]),
        tiered,
        rank,
    )
    _DREC[problem] = static
    return static


_CANDIDATES: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
_CANDIDATES_BYTES = [0]  # what they hold; past 256 MB they start afresh


def _candidates(strategies, n_axes: int) -> tuple[np.ndarray, np.ndarray]:
    """`_candidate_rows` as D-Rec's tables hold them: the candidate count of each row
    and the candidates, row after row. They depend on the strategies' assignments
    alone, so they are kept per assignment list for every mesh of as many axes (a
    mesh-shape search builds the same tables for each shape)."""
    key = (n_axes, tuple(s.assignment for s in strategies))
    got = _CANDIDATES.get(key)
    if got is None:
        rows = _candidate_rows(strategies, n_axes)  # [axes, S, 2, S]
        got = rows.sum(-1).ravel(), np.nonzero(rows.reshape(-1, len(strategies)))[1]
        size = got[0].nbytes + got[1].nbytes  # a 247-strategy table's on 3 axes: ~3 MB
        if _CANDIDATES_BYTES[0] + size > 256 << 20:
            _CANDIDATES.clear()
            _CANDIDATES_BYTES[0] = 0
        _CANDIDATES[key] = got
        _CANDIDATES_BYTES[0] += size
    return got


def _candidate_rows(strategies, n_axes: int) -> np.ndarray:
    """[axis, current strategy c, small, i]: whether strategy i is a candidate of a
    node at c cutting the axis: it agrees with c on every other axis c names (all, where
    c's assignment is empty: a fixed rule's); small: it also leaves the axis whole, or,
    if none does, as not small."""
    size = len(strategies)
    out = np.empty((n_axes, size, 2, size), dtype=bool)
    lengths = {len(s.assignment) for s in strategies}
    if len(lengths) != 1:  # mixed tables: the definition, strategy by strategy
        for ai in range(n_axes):
            whole = [s.assignment[ai : ai + 1] in ((), (None,)) for s in strategies]
            for c, base in enumerate(s.assignment for s in strategies):
                out[ai, c, 0] = [
                    all(s.assignment[a] == base[a] for a in range(len(base)) if a != ai)
                    for s in strategies
                ]
                keep = out[ai, c, 0] & whole
                out[ai, c, 1] = keep if keep.any() else out[ai, c, 0]
        return out
    (width,) = lengths
    code = np.array(
        [[-2 if a is None else int(a) for a in s.assignment] for s in strategies], dtype=np.int64
    ).reshape(size, width)
    same = code[:, None, :] == code[None, :, :]  # [c, i, axis c names]
    for ai in range(n_axes):
        match = np.delete(same, ai, axis=2).all(axis=2) if ai < width else same.all(axis=2)
        whole = match & (code[:, ai] == -2)[None, :] if ai < width else match
        out[ai, :, 0] = match
        out[ai, :, 1] = np.where(whole.any(axis=1, keepdims=True), whole, match)
    return out


def _latency_bound(problem: Problem) -> list[bool]:
    """Per cost-graph node: are all its tensors so small that moving any of them takes
    less than one collective's latency? Cutting such an op (a bias, a LayerNorm scale,
    a scalar) can only add collectives that cost their latency, and D-Rec's penalty,
    bytes over bandwidth, does not see that; so `recursive` leaves them whole (the
    final `refine` may still split them where a neighbour makes it free). The
    cheapest collective a cut can add is a gradient's all-reduce, which pays only its
    bucket share of the latency (`search.edges`). Such an op still takes a cut in D-Rec
    where that is cheaper by more than this latency (`_least_latency`): where its
    neighbours are cut already and leaving it whole would gather them (a tiny Llama's
    reshapes and residual adds between batch-split matmuls, 25 all-gathers, 15x the ILP
    optimum, before)."""
    g, cost = problem.graph, problem.cost
    names = problem.mesh.axis_names
    if not names:  # one device (a stage of a pipeline on its own): nothing to cut
        return [False] * len(problem.strategies)
    bandwidth = max(cost.link((a,))[1] for a in names)
    return (g.memo(_biggest) / bandwidth < _least_latency(problem)).tolist()


def _least_latency(problem: Problem) -> float:
    """The least latency a collective a cut adds can cost: a gradient all-reduce's
    bucket share of the fastest axis's latency (0 without mesh axes)."""
    names = problem.mesh.axis_names
    if not names:
        return 0.0
    return min(problem.cost.link((a,))[0] for a in names) * problem.bucket_share


def _biggest(g: Graph) -> np.ndarray:
    """Per cost-graph node (inputs, then ops), the bytes of its largest tensor."""
    values = [[x] for x in g.inputs] + [[*n.inputs, *n.outputs] for n in g.nodes]
    return np.array([max((g.values[x].nbytes for x in xs), default=0) for xs in values])


def _penalty_kind(problem: Problem, v: int):
    """What `_replication_penalty` of node `v` depends on besides the strategy and axis:
    its strategy table, its inputs' types and whether each is priced (and as a weight),
    its outputs' types. Nodes of one kind (the same op in every layer) share penalties."""
    n_in = problem.num_inputs
    if v < n_in:
        return ("input",)
    copies = 1 if problem.copies is None else int(problem.copies[v])
    return id(problem.strategies[v]), problem.graph.memo(_operand_kinds)[v - n_in], copies


def _operand_kinds(g: Graph) -> list[int]:
    """Per op, a number for its operands' types and whether each is an argument or made
    by an op (else a constant), and its results' types: what `_penalty_kind` reads of
    the graph (a problem's `source` holds the arguments and every op's results)."""
    made = set(g.inputs) | set(g.producer)
    args = set(g.inputs)
    kinds: dict[tuple, int] = {}
    return [
        kinds.setdefault(
            (
                tuple((g.values[x], x in args, x in made) for x in n.inputs),
                tuple(g.values[x] for x in n.outputs),
            ),
            len(kinds),
        )
        for n in g.nodes
    ]


def _replication_penalty(problem: Problem):
    """D-Rec's cut cost: bytes an op's inputs keep replicated along the axis (weights
    discounted by PARAM_REPLICATION_WEIGHT), plus outputs left partial, in seconds.
    `penalty(v)`: node `v`'s [axis, strategy] table of them."""
    g, n_in, mesh, cost = problem.graph, problem.num_inputs, problem.mesh, problem.cost
    names = mesh.axis_names
    bw = np.array([cost.link((a,))[1] for a in names])

    def penalty(v: int) -> np.ndarray:
        node = g.nodes[v - n_in]
        strategies = problem.strategies[v]
        out = np.zeros((len(names), len(strategies)))
        weights = [
            (PARAM_REPLICATION_WEIGHT if problem.source[x][0] < n_in else 1.0)
            if x in problem.source
            else None
            for x in node.inputs
        ]
        for i, s in enumerate(strategies):
            for x, spec, w in zip(node.inputs, s.in_specs, weights):
                if w is not None:
                    b = w * cost.local_bytes(g.values[x], spec)
                    used = spec.used_axes
                    for ai, axis in enumerate(names):
                        if axis not in used:
                            out[ai, i] += b
            for x, spec in zip(node.outputs, s.out_specs):
                if spec.partial:
                    b = cost.local_bytes(g.values[x], spec)
                    for ai, axis in enumerate(names):
                        if axis in spec.partial:
                            out[ai, i] += b
        # a folded problem's node stands for its copies: each would pay it
        copies = 1 if problem.copies is None else int(problem.copies[v])
        return out * (copies / bw[:, None])

    return penalty
