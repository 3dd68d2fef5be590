"""The exact strategy solvers against brute-force enumeration on small cost graphs."""

import math
import re

import numpy as np
import pytest

from autopar.search.solvers.costgraph import CostGraph
from autopar.search.solvers.dp import solve_dp
from autopar.search.solvers.ilp import solve_ilp

RTOL = 1e-9


def shapes(kind: str, n: int, rng) -> list[tuple[int, int]]:
    """Edges ``(u, v)``, ``u < v``, of a small graph of the given kind."""
    if kind == "chain":
        return [(i, i + 1) for i in range(n - 1)]
    if kind == "tree":
        return [(int(rng.integers(0, v)), v) for v in range(1, n)]
    if kind == "diamond":  # 0 -> {1, 2} -> 3, then a chain
        return [(0, 1), (0, 2), (1, 3), (2, 3)] + [(i, i + 1) for i in range(3, n - 1)]
    if kind == "triangle":  # 0 -> 1 -> 2 and 0 -> 2, then a chain
        return [(0, 1), (1, 2), (0, 2)] + [(i, i + 1) for i in range(2, n - 1)]
    if kind == "complete":  # needs the star elimination
        return [(u, v) for u in range(n) for v in range(u + 1, n)]
    assert kind == "dag"
    return [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.4]


def random_graph(kind: str, seed: int, n: int | None = None) -> CostGraph:
    """Strategy costs in microseconds, memory in megabytes: realistic magnitudes."""
    rng = np.random.default_rng(seed)
    n = n or int(rng.integers(4 if kind == "diamond" else 3, 9))
    sizes = rng.integers(2, 6, size=n)
    if math.prod(sizes) > 100_000:
        sizes = np.minimum(sizes, 3)
    cost = [rng.random(s) * 1e-6 for s in sizes]
    mem = [rng.integers(1, 64, size=s) * 2.0**20 for s in sizes]
    edges = [(u, v, rng.random((sizes[u], sizes[v])) * 1e-6) for u, v in shapes(kind, n, rng)]
    return CostGraph.build(cost, mem, edges)


def brute_force(g: CostGraph, budget: float = math.inf) -> tuple[float, float]:
    """Cheapest total over every plan within budget, and the memory of the unconstrained best."""
    n = g.num_nodes()

    def along(v, *axes):
        shape = [1] * n
        for a, s in zip(axes, v.shape):
            shape[a] = s
        return v.reshape(shape)

    total = sum(along(c, v) for v, c in enumerate(g.node_cost))
    total = total + sum(along(m, u, v) for (u, v), m in g.edges.items())
    mem = sum(along(m, v) for v, m in enumerate(g.node_mem))
    total, mem = np.broadcast_arrays(total, mem)
    best = np.unravel_index(np.argmin(total), total.shape)
    fits = np.where(mem <= budget, total, np.inf)
    return float(fits.min()), float(mem[best])


def budget_between(g: CostGraph, seed: int) -> float:
    """A budget between the smallest memory and the unconstrained optimum's."""
    _, used = brute_force(g)
    frac = np.random.default_rng(seed).uniform(0.2, 0.9)
    return g.min_memory() + frac * (used - g.min_memory())


KINDS = ["chain", "tree", "diamond", "triangle", "complete", "dag"]
CASES = [(kind, seed) for kind in KINDS for seed in range(8)]


@pytest.mark.parametrize("kind,seed", CASES)
def test_dp_matches_brute_force(kind, seed):
    g = random_graph(kind, seed)
    want, _ = brute_force(g)
    got = solve_dp(g)
    assert got.cost == pytest.approx(want, rel=RTOL)
    assert got.optimal and got.gap == 0.0
    assert got.cost == g.total(got.choice) and got.memory == g.memory(got.choice)


@pytest.mark.parametrize("kind,seed", CASES)
def test_ilp_matches_brute_force(kind, seed):
    g = random_graph(kind, seed)
    want, _ = brute_force(g)
    got = solve_ilp(g)
    assert got.cost == pytest.approx(want, rel=RTOL)
    assert got.optimal and got.gap == 0.0


@pytest.mark.parametrize("kind,seed", CASES)
def test_memory_budget(kind, seed):
    g = random_graph(kind, seed)
    budget = budget_between(g, seed)
    want, _ = brute_force(g, budget)

    ilp = solve_ilp(g, budget)
    assert ilp.memory <= budget
    assert ilp.cost == pytest.approx(want, rel=RTOL)
    assert ilp.optimal

    dp = solve_dp(g, budget)
    assert dp.memory <= budget
    assert dp.cost >= want * (1 - RTOL)
    if dp.optimal:
        assert dp.cost == pytest.approx(want, rel=RTOL)
    assert dp.gap is not None  # the elimination was exact, so the dual bound holds
    assert dp.cost * (1 - dp.gap) <= want * (1 + RTOL)


def test_budget_that_nothing_fits():
    g = random_graph("chain", 0, n=4)
    smallest = g.min_memory()
    for solve in (solve_dp, solve_ilp):
        with pytest.raises(
            ValueError, match=re.escape(f"smallest memory any plan uses is {smallest:.6g}")
        ):
            solve(g, smallest * 0.99)
    # A budget of exactly the smallest memory is feasible.
    assert solve_dp(g, smallest).memory == smallest
    assert solve_ilp(g, smallest).memory == smallest


def test_build_sums_parallel_and_reversed_edges():
    cost = [np.arange(2.0), np.arange(3.0)]
    mem = [np.ones(2), np.ones(3)]
    a = np.arange(6.0).reshape(2, 3) / 6
    g = CostGraph.build(cost, mem, [(0, 1, a), (1, 0, 2 * a.T), (0, 1, a)])
    np.testing.assert_allclose(g.edges[0, 1], 4 * a)
    assert g.total((1, 2)) == 1 + 2 + 4 * a[1, 2]
    assert g.memory((1, 2)) == 2.0


def test_check_reports_malformed_graphs():
    ok = dict(node_cost=[np.zeros(2), np.zeros(3)], node_mem=[np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match=r"must be \[S_0, S_1\] = \(2, 3\)"):
        CostGraph(**ok, edges={(0, 1): np.zeros((3, 2))}).check()
    with pytest.raises(ValueError, match="non-finite"):
        CostGraph(**ok, edges={(0, 1): np.full((2, 3), np.nan)}).check()
    with pytest.raises(ValueError, match="self-loop"):
        CostGraph(**ok, edges={(1, 1): np.zeros((3, 3))}).check()
    with pytest.raises(ValueError, match="same length"):
        CostGraph(ok["node_cost"], [np.zeros(2), np.zeros(2)]).check()
    with pytest.raises(ValueError, match="one strategy per node"):
        CostGraph(**ok).total((0,))


def test_separable_edges_need_no_variables():
    # Edges of the form a[i] + b[j] (zero, constant, one-strategy endpoint) do not
    # couple their endpoints: presolve folds them into node costs.
    rng = np.random.default_rng(0)
    cost = [rng.random(3), rng.random(4), rng.random(1)]
    mem = [np.ones(3), np.ones(4), np.ones(1)]
    separable = rng.random(3)[:, None] + rng.random(4)[None, :]
    edges = [(0, 1, np.zeros((3, 4))), (0, 1, separable), (1, 2, rng.random((4, 1)))]
    g = CostGraph.build(cost, mem, edges)
    want, _ = brute_force(g)
    ilp = solve_ilp(g)
    assert ilp.info["pruned_edges"] == 2 and ilp.info["edge_variables"] == 0
    assert ilp.cost == pytest.approx(want, rel=RTOL)
    assert solve_dp(g).cost == pytest.approx(want, rel=RTOL)


def test_dp_kernel_fallback_is_marked_heuristic():
    # With no room to fuse strategies, a complete graph cannot be eliminated.
    g = random_graph("complete", 3, n=6)
    want, _ = brute_force(g)
    got = solve_dp(g, max_states=1)
    assert not got.optimal and got.gap is None
    assert got.info["eliminations"]["kernel"] > 0
    assert got.cost >= want * (1 - RTOL) and got.cost == g.total(got.choice)


def test_ilp_warm_start():
    g = random_graph("dag", 5)
    dp = solve_dp(g)
    got = solve_ilp(g, warm_start=dp.choice)
    assert got.cost == pytest.approx(dp.cost, rel=RTOL) and got.optimal
    worst = tuple(int(np.argmax(c)) for c in g.node_cost)
    assert solve_ilp(g, warm_start=worst, time_limit=10.0).cost <= g.total(worst)
    # Out of time, the warm start stands in, with whatever bound HiGHS has.
    rushed = solve_ilp(g, time_limit=0.0, warm_start=dp.choice)
    assert rushed.cost <= dp.cost
    assert rushed.optimal or rushed.info["used_warm_start"]
    with pytest.raises(ValueError, match="warm_start"):
        solve_ilp(g, warm_start=(0,))


def test_empty_graph():
    g = CostGraph((), ())
    for solve in (solve_dp, solve_ilp):
        got = solve(g)
        assert got.choice == () and got.cost == 0.0 and got.optimal


def residual_chain(n: int, strategies: int, seed: int = 0, every: int = 4) -> CostGraph:
    """A chain with a skip edge every few nodes, like residual connections."""
    rng = np.random.default_rng(seed)
    s = strategies
    cost = [rng.random(s) * 1e-3 for _ in range(n)]
    mem = [rng.integers(1, 100, size=s) * 2.0**20 for _ in range(n)]
    edges = [(i, i + 1, rng.random((s, s)) * 1e-3) for i in range(n - 1)]
    edges += [(i, i + every, rng.random((s, s)) * 1e-3) for i in range(0, n - every, every)]
    return CostGraph.build(cost, mem, edges)


def test_dp_solves_a_long_residual_chain_by_local_eliminations():
    """A 2000-node residual chain is solved exactly with only eliminations whose work
    does not grow with the graph (no star: a star's fused node grows with its degree),
    about one per node: linear time. (It ran in ~1.1 s on 2 cores; a wall-clock bound
    here, 2 s, failed under load: speed is measured in benchmarks/, not asserted.)"""
    g = residual_chain(2000, 50)
    got = solve_dp(g)
    done = got.info["eliminations"]
    assert got.optimal and done.get("star", 0) == 0 and done.get("separable", 0) == 0
    assert sum(done.values()) <= g.num_nodes(), done


def test_dp_equals_ilp_on_a_residual_chain():
    g = residual_chain(200, 8, seed=1)
    dp, ilp = solve_dp(g), solve_ilp(g)
    assert ilp.optimal and dp.optimal
    assert dp.cost == pytest.approx(ilp.cost, rel=RTOL)


@pytest.mark.parametrize("seed", range(4))
def test_prohibitive_costs_do_not_swamp_the_objective(seed):
    # Pinning a node by pricing its other strategies at 1e6 s (as search does)
    # must not hide microsecond differences elsewhere.
    g = random_graph("dag", seed)
    cost = list(g.node_cost)
    cost[0] = np.where(np.arange(cost[0].size) == 1, cost[0], 1e6)
    g = CostGraph(tuple(cost), g.node_mem, g.edges)
    want, _ = brute_force(g)
    ilp, dp = solve_ilp(g), solve_dp(g)
    assert ilp.cost == pytest.approx(want, rel=RTOL) and ilp.choice[0] == 1
    assert dp.cost == pytest.approx(want, rel=RTOL) and dp.choice[0] == 1
    assert ilp.info["pruned_strategies"] >= cost[0].size - 1


def test_minplus_kernel_is_bit_identical_to_the_broadcast():
    """The compiled min-plus product equals numpy's broadcast definition to the last
    bit, in float32 as the elimination runs it, from a transposed operand, with inf
    entries (strategies priced out)."""
    from autopar.search.solvers.kernels import minplus

    rng = np.random.default_rng(0)
    a = rng.random((300, 17)).astype(np.float32)
    b = rng.random((90, 17)).astype(np.float32).T  # a view, as an edge's other way is
    a[3, :5] = b[2, 7:] = np.inf
    got = minplus(a, b)
    assert got.dtype == np.float32
    assert np.array_equal(got, (a[:, :, None] + b[None]).min(axis=1))


@pytest.mark.parametrize("seed", range(4))
def test_restricted_graph_is_the_pinned_problem(seed):
    """Pinning by restriction (each pinned node keeps one strategy) gives plans that keep
    the pins and cost what they cost on the whole graph; its optimum is the pinned one."""
    g = random_graph("dag", seed, n=8)
    pinned = {0: g.num_strategies()[0] - 1, 3: 0}
    r = g.restrict(pinned)
    assert r.num_strategies()[0] == 1 and r.num_strategies()[3] == 1
    sol = solve_dp(r)
    plan = g.lift_choice(sol.choice, pinned)
    assert plan[0] == pinned[0] and plan[3] == pinned[3]
    assert g.total(plan) == pytest.approx(sol.cost, rel=RTOL)
    assert g.lower_choice(plan, pinned) == list(sol.choice)
    forbid = [c.copy() for c in g.node_cost]  # the old way: other strategies priced out
    for v, s in pinned.items():
        forbid[v][np.arange(len(forbid[v])) != s] = 1.0
    assert sol.cost == pytest.approx(solve_dp(CostGraph(forbid, g.node_mem, g.edges)).cost)
    # a pinned node's edges fold into its neighbours: presolve leaves none of them
    _, edges = r.presolve()
    assert not any(u in pinned or v in pinned for u, v in edges)


def test_forest_descent_solves_a_wide_tree_exactly_in_one_round():
    """A wide tree of mixed strategy counts (hundreds of leaves, chains, a node with a
    hundred neighbours): one round's forest is the whole tree, so one round reaches the
    exact optimum (`solve_dp` is exact on a tree); on the same graph with cycles the
    descent improves the plan, never worsens it, and gives the same plan every time."""
    from autopar.search.solvers import forest

    rng = np.random.default_rng(0)
    n = 400
    k = [int(rng.choice([1, 3, 5, 8, 70])) for _ in range(n)]
    cost = [rng.random(s) for s in k]
    tree = {(int(rng.integers(0, max(1, v // 8))), v) for v in range(1, n)}
    edges = {(u, v): rng.random((k[u], k[v])) for u, v in sorted(tree)}
    g = CostGraph(cost, [np.zeros(s) for s in k], edges)
    exact = solve_dp(g)
    assert exact.optimal
    got, _ = forest.forest_descent(cost, edges, [0] * n, max_rounds=1)
    assert g.total(got) == pytest.approx(exact.cost, rel=1e-12)
    loopy = {**edges, **{(v - 3, v): rng.random((k[v - 3], k[v])) for v in range(50, n, 7)}}
    h = CostGraph(cost, [np.zeros(s) for s in k], loopy)
    start = [int(rng.integers(0, s)) for s in k]
    once = forest.forest_descent(cost, loopy, start, 40, 5)
    assert h.total(once[0]) < h.total(start)
    assert forest.forest_descent(cost, loopy, start, 40, 5) == once


@pytest.mark.parametrize("seed", range(3))
def test_forest_descent_solves_a_tree_exactly_and_never_worsens(seed):
    """On a tree every round's forest is the whole graph, so one round reaches the
    optimum (brute force); on a graph with cycles the plan never gets worse."""
    import itertools

    from autopar.search.solvers.forest import forest_descent

    rng = np.random.default_rng(seed)
    n, k = 7, 3
    cost = [rng.random(k) for _ in range(n)]
    tree = {(int(rng.integers(0, v)), v): rng.random((k, k)) for v in range(1, n)}

    def value(edges, c):
        return sum(cost[v][c[v]] for v in range(n)) + sum(
            m[c[u], c[v]] for (u, v), m in edges.items()
        )

    best = min(value(tree, c) for c in itertools.product(range(k), repeat=n))
    got, _ = forest_descent(cost, tree, [0] * n)
    assert value(tree, got) == pytest.approx(best, rel=1e-12)
    loopy = dict(tree)
    loopy.update({(0, n - 1): rng.random((k, k)), (1, n - 2): rng.random((k, k))})
    start = [int(x) for x in rng.integers(0, k, n)]
    got, _ = forest_descent(cost, loopy, start)
    assert value(loopy, got) <= value(loopy, start) + 1e-12
