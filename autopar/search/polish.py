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
one to the next edge (ViT: the cast before the weight-gradient dot first, then the
dot). Arguments are
never changed, so user pins and the data/FSDP recipes' argument specs stand."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from autopar.search.evaluate import COMBINABLE, step_seconds
from autopar.search.problem import Problem

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


def polish(
    problem: Problem,
    choice: Sequence[int],
    pinned: Mapping[int, int] = {},  # noqa: B006
) -> tuple[list[int], float]:
    """(`choice` after the polish, predicted seconds it saved)."""
    best = list(choice)
    start = price = None
    trials = 0
    for _ in range(MAX_ROUNDS):
        improved = False
        for x, s in list(latency_bound_moves(problem, best)):
            if x in pinned or s == best[x] or trials >= MAX_TRIALS:
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
