"""XLA's all-reduce combiner, simulated on a plan's collectives: the latency it saves.

XLA merges all-reduces over the same devices into one, up to a size and a count
(`COMBINE_THRESHOLD_BYTES`, `COMBINE_THRESHOLD_COUNT`). Its pass
(`CombineInstructionsByKey`) walks the program in post-order, a depth-first walk from
the outputs with operands in order, and grows one run per (kind, device group): an
all-reduce joins the open run unless it depends on one already in it (or the run is
full), in which case the run closes and a new one starts with it. Every all-reduce past
the first of a run saves one latency.

Where the runs close follows the walk, not only the dependences: a residual block
whose shortcut branch carries one batch-norm sum into the next (two all-reduces, one
after the other) and whose main branch holds the other batch norm's sums compiles to
three runs, not two, because the walk visits the shortcut's pair back to back
(ResNet: 17 all-reduces where one antichain per dependence depth said 15). So does an
optimizer's per-parameter chain (a gradient's sum, then a statistic of the summed
gradient, then the next parameter's sum: T5 with Adafactor compiled to 100
all-reduces one after another)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost.model import (
    COMBINABLE,
    COMBINE_THRESHOLD_BYTES,
    COMBINE_THRESHOLD_COUNT,
    Collective,
)
from autopar.search.build import Problem


@dataclass(frozen=True)
class _Walk:
    """What the simulation needs of a problem's graph, the same for all its plans:
    each cost-graph node's producers, and for each edge (producer, reader; None for the
    function's outputs) the step of the post-order walk at which the reader takes it."""

    preds: tuple[tuple[int, ...], ...]
    when: dict[tuple[int, int | None], int]


_WALKS: weakref.WeakKeyDictionary[Problem, _Walk] = weakref.WeakKeyDictionary()


def _walk(problem: Problem) -> _Walk:
    if problem in _WALKS:
        return _WALKS[problem]
    g, n_in = problem.graph, problem.num_inputs
    src = problem.source
    preds = tuple(
        () if v < n_in else tuple(src[x][0] for x in g.nodes[v - n_in].inputs if x in src)
        for v in range(n_in + len(g.nodes))
    )
    when: dict[tuple[int, int | None], int] = {}
    done: set[int] = set()
    t = 0

    def take(u: int, v: int | None) -> None:
        if (u, v) not in when:
            when[(u, v)] = t

    def visit(root: int) -> None:  # iterative depth-first walk, operands in order
        nonlocal t
        done.add(root)
        stack = [(root, 0)]
        while stack:
            v, j = stack[-1]
            if j == len(preds[v]):
                stack.pop()
                t += 1
                if stack:
                    take(v, stack[-1][0])
                continue
            stack[-1] = (v, j + 1)
            u = preds[v][j]
            if u in done:
                take(u, v)
            else:
                done.add(u)
                stack.append((u, 0))

    for x in g.outputs:
        if x in src:
            u = src[x][0]
            if u not in done:
                visit(u)
            take(u, None)
    for v in range(n_in + len(g.nodes)):  # what no output reads (XLA drops it)
        if v not in done:
            visit(v)
    _WALKS[problem] = got = _Walk(preds, when)
    return got


def combined_latency(
    problem: Problem, colls: Sequence[tuple[int, int | None, Collective]]
) -> float:
    """Seconds of latency the combiner saves on `colls` ((producer, reader, Collective)
    of every reshard a plan pays, `evaluate.edge_collectives`; reader None for an
    output): the module docstring's runs, each all-reduce placed in the walk where its
    reader takes it."""
    ars = [(u, v, c) for u, v, c in colls if c.kind in COMBINABLE and c.seconds > 0]
    if not ars:
        return 0.0
    walk = _walk(problem)
    # the all-reduces upstream of each node, as bits (one per all-reduce), forward
    at: dict[int, int] = {}
    for i, (_, v, _) in enumerate(ars):
        if v is not None:
            at[v] = at.get(v, 0) | (1 << i)
    first = min(at, default=len(walk.preds))
    above = [0] * len(walk.preds)
    for v in range(first, len(walk.preds)):
        b = at.get(v, 0)
        for u in walk.preds[v]:
            b |= above[u]
        above[v] = b
    runs: dict[tuple, list[int]] = {}
    for i in sorted(range(len(ars)), key=lambda i: (walk.when.get(ars[i][:2], 0), i)):
        c = ars[i][2]
        runs.setdefault((c.kind, c.axes), []).append(i)
    saved = 0.0
    for (_, axes), order in runs.items():
        n = size = count = members = 0
        for i in order:
            u, _, c = ars[i]
            if count and (
                size + c.bytes > COMBINE_THRESHOLD_BYTES
                or count == COMBINE_THRESHOLD_COUNT
                or above[u] & members
            ):
                n, size, count, members = n + 1, 0, 0, 0
            size, count, members = size + c.bytes, count + 1, members | (1 << i)
        saved += (len(order) - n - 1) * problem.cost.link(axes)[0]
    return saved
