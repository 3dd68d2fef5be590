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

import numpy as np

from autopar.cost.model import (
    COMBINABLE,
    COMBINE_THRESHOLD_BYTES,
    COMBINE_THRESHOLD_COUNT,
    Collective,
)
from autopar.search.build import Problem
from autopar.search.solvers import kernels


@dataclass(frozen=True)
class _Walk:
    """What the simulation needs of a problem's graph, the same for all its plans:
    each cost-graph node's producers, and for each edge (producer, reader; None for the
    function's outputs) the step of the post-order walk at which the reader takes it."""

    preds: tuple[tuple[int, ...], ...]
    when: dict[tuple[int, int | None], int]
    ptr: np.ndarray  # `preds` as CSR: node v's producers are flat[ptr[v]:ptr[v + 1]]
    flat: np.ndarray


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
    ptr = np.cumsum([0] + [len(p) for p in preds], dtype=np.int64)
    flat = np.array([u for p in preds for u in p], np.int64)
    _WALKS[problem] = got = _Walk(preds, when, ptr, flat)
    return got


def combined_latency(
    problem: Problem, colls: Sequence[tuple[int, int | None, Collective]]
) -> float:
    """Seconds of latency the combiner saves on `colls` ((producer, reader, Collective)
    of every reshard a plan pays, `evaluate.edge_collectives`; reader None for an
    output): the module docstring's runs, each all-reduce placed in the walk where its
    reader takes it (the runs are followed by a compiled loop, `kernels.combiner_runs`:
    the latency polish prices hundreds of plans)."""
    ars = [(u, v, c) for u, v, c in colls if c.kind in COMBINABLE and c.seconds > 0]
    if not ars:
        return 0.0
    walk = _walk(problem)
    n = len(walk.preds)
    at = np.zeros((n, (len(ars) + 63) // 64), np.uint64)
    readers = [v for _, v, _ in ars if v is not None]
    for i, (_, v, _) in enumerate(ars):
        if v is not None:
            at[v, i >> 6] |= np.uint64(1 << (i & 63))
    order = sorted(range(len(ars)), key=lambda i: (walk.when.get(ars[i][:2], 0), i))
    keys: dict[tuple, int] = {}  # (kind, axes) -> run, in the order runs open
    for i in order:
        keys.setdefault((ars[i][2].kind, ars[i][2].axes), len(keys))
    run = np.array([keys[(c.kind, c.axes)] for _, _, c in ars], np.int64)
    prod = np.array([u for u, _, _ in ars], np.int64)
    closed = kernels.combiner_runs(
        walk.ptr,
        walk.flat,
        at,
        min(readers, default=n),
        int(prod.max()),
        np.array(order, np.int64),
        run,
        prod,
        np.array([c.bytes for _, _, c in ars], np.int64),
        COMBINE_THRESHOLD_BYTES,
        COMBINE_THRESHOLD_COUNT,
        len(keys),
    )
    members = np.bincount(run, minlength=len(keys))
    saved = 0.0
    for (_, axes), r in keys.items():
        saved += int(members[r] - closed[r] - 1) * problem.cost.link(axes)[0]
    return saved
