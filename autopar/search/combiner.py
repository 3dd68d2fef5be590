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
_KEYS: dict[tuple, int] = {}  # (kind, device group axes) -> a number, for every problem


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
    when, ids = walk.when, _KEYS
    rows = np.array(
        [
            (
                when.get((u, v), 0),
                u,
                n if v is None else v,
                ids.setdefault((c.kind, c.axes), len(ids)),
                c.bytes,
            )
            for u, v, c in ars
        ],
        np.int64,
    )
    step, prod, reader, key, size = rows.T
    order = np.lexsort((np.arange(len(ars)), step))  # by walk step, then list order
    # the runs, one per (kind, device group), numbered in the order they open
    keys, first = np.unique(key[order], return_index=True)
    opened = keys[np.argsort(first)]
    number = np.zeros(len(ids), np.int64)
    number[opened] = np.arange(len(opened))
    run = number[key]
    read = np.flatnonzero(reader < n)  # the all-reduces a node reads (not outputs)
    at = np.zeros((n, (len(ars) + 63) // 64), np.uint64)
    bits = np.left_shift(np.uint64(1), (read & 63).astype(np.uint64))
    np.bitwise_or.at(at, (reader[read], read >> 6), bits)
    closed = kernels.combiner_runs(
        walk.ptr,
        walk.flat,
        at,
        int(reader[read].min()) if len(read) else n,
        int(prod.max()),
        order.astype(np.int64),
        run,
        np.ascontiguousarray(prod),
        np.ascontiguousarray(size),
        COMBINE_THRESHOLD_BYTES,
        COMBINE_THRESHOLD_COUNT,
        len(opened),
    )
    members = np.bincount(run, minlength=len(opened))
    saved = 0.0
    axes_of = list(ids)
    for r, k in enumerate(opened.tolist()):
        saved += int(members[r] - closed[r] - 1) * problem.cost.link(axes_of[k][1])[0]
    return saved
