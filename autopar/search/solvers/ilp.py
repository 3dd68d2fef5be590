"""Alpa's integer program for strategy choice (docs/algorithms.md, section 5), on HiGHS.

Variables, for a cost graph with node costs ``c_v`` and edge matrices ``R_uv``:

    s_v[i]     binary, one-hot over node v's strategies      sum_i s_v[i] = 1
    e_uv[i,j]  in [0, 1], one per strategy pair of edge u--v
               sum_j e_uv[i, j] = s_u[i]       sum_i e_uv[i, j] = s_v[j]

    minimize   sum_v c_v . s_v + sum_uv R_uv . e_uv
    subject to sum_v mem_v . s_v <= budget

Once the ``s`` are integral the two marginal constraints force ``e_uv`` to the
single pair ``(s_u, s_v)``, so ``e`` need not be declared integer. Edges whose
matrix is ``a[i] + b[j]`` (all-zero ones included) are folded into the node
costs by :meth:`CostGraph.presolve` and get no ``e`` variables.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from autopar.search.solvers.costgraph import CostGraph, Solution

__all__ = ["solve_ilp"]

# HiGHS treats tiny objective coefficients as zero and stops at an absolute
# gap of 1e-6, so the objective (seconds) is rescaled to a largest coefficient
# of 1 and both gaps are set to zero. scipy's milp forwards options it does not
# know (mip_abs_gap) to HiGHS, with a warning.
_HIGHS_OPTIONS = {"mip_abs_gap": 0.0, "mip_rel_gap": 0.0}
_MAX_TIGHTENINGS = 3
# Strategies are dropped only when provably worse than a known plan by this much.
_PRUNE_RTOL = 1e-9


def _cheap_plan(g: CostGraph, budget: float, warm) -> tuple[int, ...]:
    """The fastest within budget of: each node's fastest strategy, each node's
    fastest smallest-memory strategy (always fits), and the warm start."""
    plans = [
        tuple(int(np.argmin(c)) for c in g.node_cost),
        tuple(
            int(np.argmin(np.where(m <= m.min(), c, np.inf)))
            for c, m in zip(g.node_cost, g.node_mem)
        ),
    ]
    if warm is not None:
        plans.append(warm)
    return min((p for p in plans if g.memory(p) <= budget), key=g.total)


def _may_be_optimal(cost, edges, upper: float) -> list[np.ndarray]:
    """Per node, a mask of the strategies that a plan costing at most ``upper`` may use.

    A plan with ``s_v = i`` costs at least ``c_v[i]``, plus every other node's
    cheapest strategy, plus each edge's cheapest entry (its cheapest entry in
    row / column ``i`` for edges at ``v``). Strategies whose bound exceeds a
    known plan's time are dropped: this removes prohibitive costs (such as a
    large price put on every strategy but the pinned one) that would
    otherwise swamp the scale of the objective.
    """
    node_min = [c.min() for c in cost]
    base = math.fsum(node_min) + math.fsum(m.min() for m in edges.values())
    extra = [c - c0 for c, c0 in zip(cost, node_min)]
    for (u, v), m in edges.items():
        m0 = m.min()
        extra[u] = extra[u] + (m.min(axis=1) - m0)
        extra[v] = extra[v] + (m.min(axis=0) - m0)
    slack = _PRUNE_RTOL * max(abs(upper), abs(base))
    return [base + x <= upper + slack for x in extra]


def _build(cost, mem, edges):
    """Objective, bounds and integrality, plus the equality-constraint matrix."""
    sizes = [c.shape[0] for c in cost]
    offset = np.concatenate([[0], np.cumsum(sizes)])
    n_s = int(offset[-1])
    obj = [np.concatenate(cost)]
    rows, cols, vals = [], [], []
    # One-hot rows 0..n-1.
    rows.append(np.repeat(np.arange(len(cost)), sizes))
    cols.append(np.arange(n_s))
    vals.append(np.ones(n_s))
    row, col = len(cost), n_s
    for (u, v), m in edges.items():
        su, sv = m.shape
        e = col + np.arange(su * sv).reshape(su, sv)
        obj.append(m.reshape(-1))
        # sum_j e[i, j] - s_u[i] = 0, then sum_i e[i, j] - s_v[j] = 0.
        rows += [row + np.repeat(np.arange(su), sv), row + np.arange(su)]
        cols += [e.reshape(-1), offset[u] + np.arange(su)]
        rows += [row + su + np.tile(np.arange(sv), su), row + su + np.arange(sv)]
        cols += [e.reshape(-1), offset[v] + np.arange(sv)]
        vals += [np.ones(su * sv), -np.ones(su), np.ones(su * sv), -np.ones(sv)]
        row += su + sv
        col += su * sv
    a = sparse.csr_array(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, col)
    )
    rhs = np.zeros(row)
    rhs[: len(cost)] = 1.0
    integrality = np.zeros(col)
    integrality[:n_s] = 1
    return np.concatenate(obj), a, rhs, integrality, offset


def _solve(obj, upper, a, rhs, integrality, mem_row, mem_rhs, time_limit):
    constraints = [LinearConstraint(a, rhs, rhs)]
    if mem_row is not None:
        constraints.append(LinearConstraint(mem_row, -np.inf, mem_rhs))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
        return milp(
            obj,
            integrality=integrality,
            bounds=Bounds(0.0, upper),
            constraints=constraints,
            options={"time_limit": float(time_limit), **_HIGHS_OPTIONS},
        )


def _checked_warm_start(g: CostGraph, warm_start, budget):
    if warm_start is None:
        return None
    choice = tuple(int(s) for s in warm_start)
    try:
        g.total(choice)
    except ValueError as e:
        raise ValueError(f"warm_start is not a plan for this graph: {e}") from None
    if g.memory(choice) > budget:
        return None
    return choice


def solve_ilp(
    g: CostGraph,
    memory_budget: float = math.inf,
    time_limit: float = 60.0,
    warm_start: Sequence[int] | None = None,
) -> Solution:
    """Choose one strategy per node minimizing total time, as a MILP on HiGHS.

    Args:
      g: the cost graph.
      memory_budget: bytes the plan may use (``g.memory``); ``inf`` for none.
      time_limit: seconds HiGHS may run.
      warm_start: a known plan (e.g. from ``solve_dp``). scipy's ``milp`` takes
        no MIP start, so it serves as an upper bound: it prunes strategies
        that provably cannot beat it, the better of it and HiGHS's incumbent
        is returned, and the gap is measured from that. Ignored (noted in
        ``info``) if it exceeds the budget.

    Returns:
      A :class:`Solution`: ``optimal`` (with ``gap == 0``) when HiGHS proves
      optimality, else ``gap`` from HiGHS's dual bound (None without one).
      If HiGHS finds no plan in time, the warm start or a trivial plan (each
      node's fastest strategy, or its smallest-memory one) is returned.
      ``info`` has the solver status, message, dual bound (seconds), node
      count, and the sizes of the program and of what presolve pruned.

    Raises:
      ValueError: if the graph or warm start is malformed, or no plan fits the
        budget (the message gives the smallest memory possible).
    """
    start = time.perf_counter()
    g.check()
    g.check_budget(memory_budget)
    warm = _checked_warm_start(g, warm_start, memory_budget)
    if g.num_nodes() == 0:
        return Solution((), 0.0, 0.0, True, 0.0, time.perf_counter() - start, {})
    cheap = _cheap_plan(g, memory_budget, warm)
    cost, edges = g.presolve()
    obj, a, rhs, integrality, offset = _build(cost, g.node_mem, edges)
    keep = _may_be_optimal(cost, edges, g.total(cheap))
    upper = np.ones(len(obj))
    upper[: offset[-1]] = np.concatenate(keep)
    col = int(offset[-1])
    for (u, v), m in edges.items():
        upper[col : col + m.size] = (keep[u][:, None] & keep[v][None, :]).reshape(-1)
        col += m.size
    obj = np.where(upper > 0, obj, 0.0)
    scale = 1.0 / max(float(np.abs(obj).max(initial=0.0)), 1e-300)
    mem_row = mem_rhs = None
    if math.isfinite(memory_budget):
        mem = np.concatenate(g.node_mem)
        mem_scale = 1.0 / max(float(np.abs(mem).max(initial=0.0)), 1e-300)
        cols = np.arange(len(mem))
        mem_row = sparse.csr_array(
            (mem * mem_scale, (np.zeros_like(cols), cols)), shape=(1, len(obj))
        )
        mem_rhs = memory_budget * mem_scale

    info: dict[str, object] = {
        "variables": len(obj),
        "edge_variables": len(obj) - int(offset[-1]),
        "pruned_edges": len(g.merged_edges()) - len(edges),
        "pruned_strategies": int(offset[-1]) - int(upper[: offset[-1]].sum()),
        "warm_start_over_budget": warm_start is not None and warm is None,
    }
    choice = None
    for _ in range(_MAX_TIGHTENINGS):
        res = _solve(obj * scale, upper, a, rhs, integrality, mem_row, mem_rhs, time_limit)
        info.update(status=res.status, message=res.message, nodes=res.mip_node_count)
        if res.x is None:
            break
        choice = tuple(int(np.argmax(res.x[offset[v] : offset[v + 1]])) for v in range(len(cost)))
        excess = g.memory(choice) - memory_budget
        if excess <= 0:
            break
        # HiGHS accepted the row within its feasibility tolerance; tighten it and retry.
        mem_rhs -= 2 * excess * mem_scale
        choice = None
    proven = res.status == 0 and choice is not None
    dual = res.mip_dual_bound / scale if res.mip_dual_bound is not None else None
    info["dual_bound"] = dual

    # The warm start (or a trivial plan) stands in when HiGHS has nothing better.
    best = cheap if choice is None or g.total(cheap) < g.total(choice) else choice
    info["used_warm_start"] = best is not choice and best == warm
    total = g.total(best)
    if proven:
        gap = 0.0
    elif dual is not None and np.isfinite(dual):
        gap = max(0.0, (total - dual) / abs(total)) if total else 0.0
    else:
        gap = None
    return Solution(
        choice=best,
        cost=total,
        memory=g.memory(best),
        optimal=proven,
        gap=gap,
        seconds=time.perf_counter() - start,
        info=info,
    )
