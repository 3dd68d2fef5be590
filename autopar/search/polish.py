"""Polish a plan on its full price around the collectives that only pay latency.

Every engine minimises pairwise edge prices, which charge each collective its link
latency. XLA merges independent all-reduces over one device group into one
(`combiner.combined_latency`), which the pairwise prices cannot see: an all-reduce
that joins the gradients' combined one costs only its bytes. So the engines can
prefer two tiny all-gathers (two latencies) to a partial sum that would ride along
for free. ViT-B/16's data-parallel plan did: it gathered the batch-split logits
gradient and pooled features to compute the classifier's weight gradient whole.

The polish is greedy descent on `step_seconds` (the plan's full price, combining
included). For each reshard that pays a collective the combiner leaves alone and
whose time is mostly link latency, it tries the reader's strategies that read the
value as it is made, and the producer's that make it as it is read; a change stays
only when the price drops. Reshards are found again each round, as a change can move
one to the next edge (on ViT-B/16 three ops change: the cast of the logits' gradient,
the bias gradient's sum and the weight-gradient dot). Arguments are never changed,
so user pins and the data/FSDP recipes' argument specs stand. Changes that need
several ops to move at once (a whole replicated head of small ops) are out of its
reach."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence

import networkx as nx
import numpy as np

from autopar.cost.model import COMBINABLE
from autopar.search.build import Problem
from autopar.search.combiner import combined_latency
from autopar.search.evaluate import output_spec
from autopar.search.fold import Fold
from autopar.sharding import Spec
from autopar.strategies.settle import settle_spec

MAX_ROUNDS = 4
MAX_TRIALS = 200  # priced changes per plan
MIN_GAIN_S = 1e-8  # a change must save more than this, else it is noise


def latency_bound_moves(
    problem: Problem, choice: Sequence[int], readers: Sequence[int] | None = None
) -> Iterator[tuple[int, int]]:
    """(op, strategy) changes that would drop a reshard paying a collective the combiner
    leaves alone and whose time is mostly latency: the reader's strategies that read
    the value as made, the producer's that make it as read. `readers`: only the reshards
    into these graph nodes (default all)."""
    g, n_in, strategies = problem.graph, problem.num_inputs, problem.strategies
    index = _SPECS.setdefault(problem, {})
    seen: set[tuple[int, int]] = set()
    for node in g.nodes if readers is None else map(g.nodes.__getitem__, readers):
        v = n_in + node.id
        for j, x in enumerate(node.inputs):
            if x not in problem.source:
                continue
            u, k = problem.source[x]
            src = strategies[u][choice[u]].out_specs[k]
            dst = strategies[v][choice[v]].in_specs[j]
            if src == dst:
                continue
            colls = problem.cost.reshard(g.values[x], src, dst).collectives
            if not any(
                c.kind not in COMBINABLE and c.seconds <= 2 * problem.cost.link(c.axes)[0]
                for c in colls
            ):
                continue
            moves = [(v, s) for s in _with_spec(index, strategies[v], "in_specs", j, src)]
            if u >= n_in:
                moves += [(u, s) for s in _with_spec(index, strategies[u], "out_specs", k, dst)]
            for m in moves:
                if m not in seen:
                    seen.add(m)
                    yield m


_USES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _with_spec(index: dict, table, side: str, j: int, spec: Spec) -> Sequence[int]:
    """The strategies of `table` whose operand (`side` "in_specs") or result
    ("out_specs") `j` is `spec`, in order; each table's specs indexed once per problem
    in `index` (repeated layers share their tables; the polish asks every round)."""
    key = (id(table), side, j)
    by = index.get(key)
    if by is None:
        by = index[key] = {}
        for s, st in enumerate(table):
            by.setdefault(getattr(st, side)[j], []).append(s)
    return by.get(spec, ())


def _uses(problem: Problem) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[int]]]:
    """({value: [(reader, input index)]}, {value: [function output index]}) of the
    values ops make or arguments hold, once per problem (the polish of every engine's
    plan reads them)."""
    if problem not in _USES:
        g, n_in = problem.graph, problem.num_inputs
        reads: dict[int, list[tuple[int, int]]] = {}
        for node in g.nodes:
            for j, x in enumerate(node.inputs):
                if x in problem.source:
                    reads.setdefault(x, []).append((n_in + node.id, j))
        outs: dict[int, list[int]] = {}
        for o, x in enumerate(g.outputs):
            if x in problem.source:
                outs.setdefault(x, []).append(o)
        _USES[problem] = reads, outs
    return _USES[problem]


def _stored(p: Problem, x: int, src: Spec, pick, reads, outs) -> Spec:
    """The spec value `x`, made in `src`, is read from (`settle_partials`, for one value):
    a partial sum made by an op is summed once, into `settle_spec` of its uses' specs."""
    if not src.partial or p.source[x][0] < p.num_inputs:
        return src
    wants: Counter[Spec] = Counter()
    for _, spec in dict.fromkeys((v, p.strategies[v][pick(v)].in_specs[j]) for v, j in reads):
        wants[spec] += 1
    for o in outs:
        wants[output_spec(p, o, pick)] += 1
    return settle_spec(src, wants) if wants else src


class _Local:
    """A change's price without combining, from the reshards of the values it touches
    (each value pays once per distinct spec its readers want, as in `edge_collectives`),
    to skip the full re-pricing of changes that cannot pay off."""

    def __init__(self, problem: Problem):
        self.p = problem
        self.reads, self.outs = _uses(problem)
        self.at: Sequence[int] | None = None  # the choice `before` holds prices under
        self.before: dict[int, tuple[float, float]] = {}

    def _price(self, x: int, pick) -> tuple[float, float]:
        """(seconds, all-reduce latencies) of value `x`'s reshards when op v runs
        strategy `pick(v)`."""
        p = self.p
        u, k = p.source[x]
        src = p.strategies[u][pick(u)].out_specs[k]
        reads, outs = self.reads.get(x, ()), self.outs.get(x, ())
        wanted = {p.strategies[v][pick(v)].in_specs[j] for v, j in reads}
        wanted |= {output_spec(p, o, pick) for o in outs}
        stored = _stored(p, x, src, pick, reads, outs) if wanted else src
        colls = list(p.cost.reshard(p.graph.values[x], src, stored).collectives)
        for dst in wanted - {stored}:
            colls += p.cost.reshard(p.graph.values[x], stored, dst).collectives
        secs = lat = 0.0
        for c in colls:
            secs += c.seconds
            if c.kind in COMBINABLE:
                lat += p.cost.link(c.axes)[0]
        return secs, lat

    def may_pay(self, choice: Sequence[int], x: int, s: int) -> bool:
        """Whether changing op `x` to strategy `s` could lower the full price: it does
        locally, or by less than the latency of the all-reduces it adds, which the
        combiner might merge."""
        p = self.p
        node = p.graph.nodes[x - p.num_inputs]
        values = {v for v in node.inputs if v in p.source} | set(node.outputs)
        own = p.compute_time()[x]
        delta = float(own[s] - own[choice[x]])
        if p.waits:
            moved = [s if v == x else c for v, c in enumerate(choice)]
            delta += p.wait_time(moved, (x,)) - p.wait_time(choice, (x,))
        added = 0.0
        if choice is not self.at:  # a value's price under `choice`, once per choice
            self.at, self.before = choice, {}
        for v in values:
            if v not in p.source:
                continue
            before = self.before.get(v)
            if before is None:
                before = self.before[v] = self._price(v, choice.__getitem__)
            after = self._price(v, lambda w: s if w == x else choice[w])
            delta += after[0] - before[0]
            added += after[1] - before[1]
        return delta - max(added, 0.0) < -MIN_GAIN_S


def polish(
    problem: Problem,
    choice: Sequence[int],
    pinned: Mapping[int, int] = {},  # noqa: B006
    stop: Callable[[], bool] | None = None,
    folded: Fold | None = None,
) -> tuple[list[int], float]:
    """(`choice` after the polish, predicted seconds it saved); it ends early, keeping
    the changes made so far, once `stop()` says so (`time_limit=`). Each trial is
    priced by its delta (`Pricing`), and so is the saving (it equals the full price's
    change; `tests/test_planning_time.py`).

    `folded` (the `search.fold` the engine searched): the moves are looked for in one
    copy of each repeated layer's op, and each is made in every copy at once (the plan
    stays layer-uniform, and the search of moves does not grow with depth)."""
    best = list(choice)
    pricing: Pricing | None = None
    trials = 0
    changed = False
    local = None
    members = folded.members if folded is not None else None
    readers = None
    if members is not None:
        n_in = problem.num_inputs
        readers = sorted(m[0] - n_in for m in members if m[0] >= n_in)

    def copies(x: int, s: int) -> list[tuple[int, int]]:
        if members is None:
            return [(x, s)]
        return [(y, s) for y in members[folded.idx[x]]]

    for _ in range(MAX_ROUNDS):
        improved = False
        for x, s in list(latency_bound_moves(problem, best, readers)):
            if x in pinned or s == best[x] or trials >= MAX_TRIALS:
                continue
            if stop is not None and stop():
                trials = MAX_TRIALS
                break
            local = local or _Local(problem)
            if not local.may_pay(best, x, s):
                continue
            pricing = pricing or Pricing(problem, best)
            trials += 1
            group = copies(x, s)
            if any(y in pinned for y, _ in group):
                continue
            if len(group) > 1:
                if _move_all(pricing, group) < -MIN_GAIN_S:
                    best, improved, changed = list(pricing.choice), True, True
            elif pricing.delta(x, s) < -MIN_GAIN_S:
                pricing.commit()
                best, improved, changed = list(pricing.choice), True, True
            else:
                pricing.undo()
        if not improved or trials >= MAX_TRIALS:
            break
    for group in carried_sums(problem, best):
        if trials >= MAX_TRIALS or any(x in pinned for x, _ in group):
            continue
        if stop is not None and stop():
            break
        pricing = pricing or Pricing(problem, best)
        trials += 1
        if _move_all(pricing, group) < -MIN_GAIN_S:
            best, changed = list(pricing.choice), True
    if not changed:
        return best, 0.0
    return best, pricing.initial - pricing.price


def carried_sums(problem: Problem, choice: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The ops that carry a Partial sum on (read one, make one), grouped where one reads
    another's output, each with its summed twin (the same strategy reading and making
    whole values): moving a group sums at their sources what it carried on.

    The engines' pairwise prices see no difference between summing where a sum is made
    and a few ops later (the same all-reduce), or prefer the later sum where two
    carried sums meet in an add (one all-reduce for two). But sums made side by side,
    a batch norm's statistics, are independent where they are made, and XLA combines
    them into one all-reduce; carried on, they meet ops that make one depend on the
    other, one latency each (MobileNet's data-parallel plan paid 13 more than plain
    data parallelism). A single-op move cannot reach that: a carrier moved alone makes
    its neighbours read a summed value as a Partial one. So the polish tries each
    group at once, on the full price."""
    g, n_in, strategies = problem.graph, problem.num_inputs, problem.strategies
    twin: dict[int, int] = {}
    for node in g.nodes:
        v = n_in + node.id
        st = strategies[v][choice[v]]
        if not (any(sp.partial for sp in st.in_specs) and any(o.partial for o in st.out_specs)):
            continue
        ins = tuple(sp.without_partial() for sp in st.in_specs)
        outs = tuple(o.without_partial() for o in st.out_specs)
        t = next(
            (i for i, o in enumerate(strategies[v]) if o.in_specs == ins and o.out_specs == outs),
            None,
        )
        if t is not None:
            twin[v] = t
    joined = nx.utils.UnionFind(twin)
    for v in twin:
        for x in g.nodes[v - n_in].inputs:
            u = problem.source.get(x, (None,))[0]
            if u in twin:
                joined.union(u, v)
    return sorted([(v, twin[v]) for v in sorted(group)] for group in joined.to_sets())


def _move_all(pricing: Pricing, moves: Sequence[tuple[int, int]]) -> float:
    """Apply every (op, strategy) of `moves` at once; keep them if the price drops, else
    put the ops back (undoing the change's log, no re-pricing). Returns the change kept
    (0 when put back)."""
    total = pricing.delta_all(moves)
    if total < -MIN_GAIN_S:
        pricing.commit()
        return total
    pricing.undo()
    return 0.0


def lean_arguments(
    problem: Problem,
    choice: Sequence[int],
    pinned: Mapping[int, int] = {},  # noqa: B006
) -> list[int]:
    """At equal price, the plan whose arguments take less memory: each argument no pin
    fixes moves to its leanest strategy whose objective terms (its own and its edges',
    neighbours held) are no higher than the current one's. E.g. a gemv computed
    row-split reads its matrix split by rows at the same price as whole (each device
    slices its rows for free), and split it keeps a quarter of it per device. The
    caller keeps the result only if the full price did not rise (`search.run`)."""
    from autopar.search.engines import neighbour_tables

    nb = neighbour_tables(problem)
    lean = list(choice)
    for v in range(problem.num_inputs):
        if v in pinned:
            continue
        mem = problem.node_mem[v]
        local = np.array(problem.node_time[v], dtype=np.float64)
        for u, m in nb[v]:
            local = local + m[lean[u]]
        now = lean[v]
        tie = local <= local[now] + TIE_RTOL * abs(local[now])
        cheaper = np.flatnonzero(tie & (mem < mem[now]))
        if len(cheaper):
            lean[v] = int(cheaper[np.lexsort((local[cheaper], mem[cheaper]))[0]])
    return lean


TIE_RTOL = 1e-12  # objective terms this close count as equal (`lean_arguments`)


class Pricing:
    """`evaluate.step_seconds` of a choice kept up to date under one-op changes.

    The price is compute (each op's own time) + the collectives of every reshard (each
    value pays once per distinct spec its readers want, as in `edge_collectives`) -
    the latency the all-reduce combiner saves (`combiner.combined_latency`). A change
    of op x re-prices the values x reads and makes; where that moves an all-reduce,
    the combiner's runs are counted again (they follow XLA's walk of the whole
    program). `delta(x, s)` applies the change and returns the price's change;
    `commit()` keeps it, `undo()` restores the state before it."""

    def __init__(self, problem: Problem, choice: Sequence[int]):
        p = self.p = problem
        g, n_in = p.graph, p.num_inputs
        self.log: list = []  # (dict, list or self; key; old value) of the change under way
        self.choice = list(choice)
        self.n_in = n_in
        self.END = n_in + len(g.nodes)  # the position of the function's outputs
        self.reads, self.outs = _uses(p)
        self.node_compute = p.compute_time()
        self.compute = sum(float(self.node_compute[v][s]) for v, s in enumerate(self.choice))
        self.compute += p.wait_time(self.choice)
        self.paid: dict[int, tuple] = {}  # value -> ((position, Collective), ...)
        # value -> what the combiner reads of its pays (`_combined`), in paid's order
        self.reduces: dict[int, tuple] = {}
        self.comm = 0.0
        for x in self.reads.keys() | self.outs.keys():
            self.paid[x] = self._pays(x)
            self.reduces[x] = self._reduces(x, self.paid[x])
            self.comm += sum(c.seconds for _, c in self.paid[x])
        self.saved = self._combined()
        self.initial = self.price  # the choice's price before any change
        self.log = []

    @property
    def price(self) -> float:
        return self.compute + self.comm - self.saved

    # ---- the pieces of the price -----------------------------------------------------------
    def _pays(self, x: int) -> tuple:
        """((position, Collective), ...) value `x`'s reshards pay: the position of the
        first reader wanting each distinct spec ((reader, input index, k-th collective)),
        or (END, output index, k) when only outputs want it."""
        p, pick = self.p, self.choice.__getitem__
        u, k = p.source[x]
        src = p.strategies[u][pick(u)].out_specs[k]
        t = p.graph.values[x]
        reads, outs = self.reads.get(x, ()), self.outs.get(x, ())
        stored = _stored(p, x, src, pick, reads, outs)
        # a partial sum settled elsewhere is summed once, at its first use (as in
        # `edge_collectives`); every use reshards from the sum
        whole = not src.partial  # then stored is src, and a read of it pays nothing
        first = [] if whole else list(p.cost.reshard(t, src, stored).collectives)
        out, seen = [], set()
        for v, j in reads:
            dst = p.strategies[v][pick(v)].in_specs[j]
            if whole and (dst is src or dst == src):
                continue
            if dst not in seen:
                seen.add(dst)
                colls = first + list(p.cost.reshard(t, stored, dst).collectives)
                first = []
                out += [((v, j, i), c) for i, c in enumerate(colls)]
        for o in outs:
            dst = output_spec(p, o, pick)
            if dst not in seen:
                seen.add(dst)
                colls = first + list(p.cost.reshard(t, stored, dst).collectives)
                first = []
                out += [((self.END, o, i), c) for i, c in enumerate(colls)]
        return tuple(out)

    def _set(self, obj, key, value) -> None:
        """obj[key] = value (an existing entry of a dict or a list), undoably."""
        self.log.append((obj, key, obj[key]))
        obj[key] = value

    # ---- changes ---------------------------------------------------------------------------------
    def delta(self, x: int, s: int) -> float:
        """Run op `x` with strategy `s`; the price's change (kept until `commit`/`undo`)."""
        return self.delta_all([(x, s)])

    def delta_all(self, moves: Sequence[tuple[int, int]]) -> float:
        """Run each op `x` of `moves` with its strategy `s`, at once: the values they
        read and make priced again once, the combiner's runs counted again once if an
        all-reduce moved. The price's change (kept until `commit`/`undo`)."""
        p, before = self.p, self.price
        self.log = []
        values: dict[int, None] = {}
        moved = {x for x, _ in moves}
        waited = p.wait_time(self.choice, moved) if p.waits else 0.0
        for x, s in moves:
            old = self.choice[x]
            self._set(self.choice, x, s)
            own = self.node_compute[x]
            self._set_scalar("compute", self.compute + float(own[s] - own[old]))
            node = p.graph.nodes[x - self.n_in]
            values.update(dict.fromkeys([v for v in node.inputs if v in p.source]))
            values.update(dict.fromkeys(node.outputs))
        if p.waits:
            self._set_scalar("compute", self.compute + p.wait_time(self.choice, moved) - waited)
        combined = False  # whether an all-reduce moved
        comm = self.comm
        for v in values:
            if v not in self.paid:
                continue
            old_pays, new_pays = self.paid[v], self._pays(v)
            if old_pays == new_pays:
                continue
            self._set(self.paid, v, new_pays)
            self._set(self.reduces, v, self._reduces(v, new_pays))
            comm += sum(c.seconds for _, c in new_pays) - sum(c.seconds for _, c in old_pays)
            combined = combined or any(
                c.kind in COMBINABLE and c.seconds > 0 for _, c in (*old_pays, *new_pays)
            )
        self._set_scalar("comm", comm)
        if combined:
            self._set_scalar("saved", self._combined())
        return self.price - before

    def _reduces(self, x: int, pays: tuple) -> tuple:
        """Of value `x`'s `pays`, what the combiner combines: (producer, reader or None
        for an output, Collective) of each all-reduce that takes time."""
        u = self.p.source[x][0]
        return tuple(
            (u, None if pos[0] == self.END else pos[0], c)
            for pos, c in pays
            if c.kind in COMBINABLE and c.seconds > 0
        )

    def _combined(self) -> float:
        """`combiner.combined_latency` of the collectives the plan pays now (in the
        order `evaluate.edge_collectives` lists them)."""
        return combined_latency(self.p, [r for rs in self.reduces.values() for r in rs])

    def _set_scalar(self, name: str, value: float) -> None:
        self.log.append((self, name, getattr(self, name)))
        setattr(self, name, value)

    def commit(self) -> None:
        self.log = []

    def undo(self) -> None:
        for obj, key, old in reversed(self.log):
            if obj is self:
                setattr(self, key, old)
            else:
                obj[key] = old
        self.log = []
