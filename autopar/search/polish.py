"""Polish a plan on its full price around the collectives that only pay latency.

Every engine minimises pairwise edge prices, which charge each collective its link
latency. XLA merges independent all-reduces over one device group into one
(`evaluate.combined_latency`), which the pairwise prices cannot see: an all-reduce
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

from collections.abc import Iterator, Mapping, Sequence

from autopar.search.build import Problem
from autopar.search.evaluate import COMBINABLE, output_spec, step_seconds

MAX_ROUNDS = 4
MAX_TRIALS = 200  # full re-pricings per plan, each a walk over the whole graph
MIN_GAIN_S = 1e-8  # a change must save more than this, else it is noise


def latency_bound_moves(problem: Problem, choice: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(op, strategy) changes that would drop a reshard paying a collective the combiner
    leaves alone and whose time is mostly latency: the reader's strategies that read
    the value as made, the producer's that make it as read."""
    g, n_in, strategies = problem.graph, problem.num_inputs, problem.strategies
    seen: set[tuple[int, int]] = set()
    for node in g.nodes:
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
            moves = [(v, s) for s, st in enumerate(strategies[v]) if st.in_specs[j] == src]
            if u >= n_in:
                moves += [(u, s) for s, st in enumerate(strategies[u]) if st.out_specs[k] == dst]
            for m in moves:
                if m not in seen:
                    seen.add(m)
                    yield m


class _Local:
    """A change's price without combining, from the reshards of the values it touches
    (each value pays once per distinct spec its readers want, as in `edge_collectives`),
    to skip the full re-pricing of changes that cannot pay off."""

    def __init__(self, problem: Problem):
        self.p = problem
        g, n_in = problem.graph, problem.num_inputs
        self.reads: dict[int, list[tuple[int, int]]] = {}
        for node in g.nodes:
            for j, x in enumerate(node.inputs):
                if x in problem.source:
                    self.reads.setdefault(x, []).append((n_in + node.id, j))
        self.outs: dict[int, list[int]] = {}
        for o, x in enumerate(g.outputs):
            if x in problem.source:
                self.outs.setdefault(x, []).append(o)

    def _price(self, x: int, pick) -> tuple[float, float]:
        """(seconds, all-reduce latencies) of value `x`'s reshards when op v runs
        strategy `pick(v)`."""
        p = self.p
        u, k = p.source[x]
        src = p.strategies[u][pick(u)].out_specs[k]
        wanted = {p.strategies[v][pick(v)].in_specs[j] for v, j in self.reads.get(x, ())}
        wanted |= {output_spec(p, o, pick) for o in self.outs.get(x, ())}
        secs = lat = 0.0
        for dst in wanted - {src}:
            for c in p.cost.reshard(p.graph.values[x], src, dst).collectives:
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
        delta = float(p.node_time[x][s] - p.node_time[x][choice[x]])
        added = 0.0
        for v in values:
            if v not in p.source:
                continue
            before = self._price(v, lambda w: choice[w])
            after = self._price(v, lambda w: s if w == x else choice[w])
            delta += after[0] - before[0]
            added += after[1] - before[1]
        return delta - max(added, 0.0) < -MIN_GAIN_S


def polish(
    problem: Problem,
    choice: Sequence[int],
    pinned: Mapping[int, int] = {},  # noqa: B006
) -> tuple[list[int], float]:
    """(`choice` after the polish, predicted seconds it saved)."""
    best = list(choice)
    start = price = None
    trials = 0
    local = None
    for _ in range(MAX_ROUNDS):
        improved = False
        for x, s in list(latency_bound_moves(problem, best)):
            if x in pinned or s == best[x] or trials >= MAX_TRIALS:
                continue
            local = local or _Local(problem)
            if not local.may_pay(best, x, s):
                continue
            if price is None:
                start = price = step_seconds(problem, best)
            trial = list(best)
            trial[x] = s
            trials += 1
            t = step_seconds(problem, trial)
            if t < price - MIN_GAIN_S:
                best, price, improved = trial, t, True
        if not improved or trials >= MAX_TRIALS:
            break
    return best, (start - price) if price is not None else 0.0
