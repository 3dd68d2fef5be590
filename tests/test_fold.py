"""Every engine searches a deep stack folded to three of its layers (autopar/search/fold.py)."""

import jax
import numpy as np
import pytest
from helpers import assert_trees_close
from test_layers import CFG, MESH, gpt_problem

import autopar
from autopar.examples.models import gpt
from autopar.search import fold as FO
from autopar.search import search


def test_a_deep_stack_folds_to_the_same_problem_whatever_its_depth():
    sizes = {}
    for layers in (4, 6, 8):
        p = gpt_problem(layers)
        f = FO.fold(p)
        assert f is not None and f.nodes == len(p.strategies)
        assert f.groups["h"]["merged"] == layers - 3  # the first, one representative, the last
        sizes[layers] = len(f.problem.strategies)
    assert len(set(sizes.values())) == 1, sizes
    assert sizes[8] < len(gpt_problem(8).strategies) / 2


def test_a_folded_plan_costs_what_its_lift_costs():
    p = gpt_problem(6)
    f = FO.fold(p)
    g, q = p.cost_graph(), f.problem.cost_graph()
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = [int(rng.integers(len(s))) for s in f.problem.strategies]
        lifted = f.lift(x)
        assert all(lifted[v] == x[f.idx[v]] for v in range(len(lifted)))
        assert g.total(lifted) == pytest.approx(q.total(x), rel=1e-12)
        assert g.memory(lifted) == pytest.approx(q.memory(x), rel=1e-12)


def test_the_folded_graph_reads_every_value_after_it_is_made():
    """The backward pass runs the layers the other way: the representative's backward
    would read the gradient its own merged copy makes; it reads the last layer's."""
    f = FO.fold(gpt_problem(6))
    g = f.problem.graph
    made = set(g.inputs) | set(g.consts)
    for node in g.nodes:
        assert node.id == g.nodes.index(node)
        assert all(x in made for x in node.inputs), node.key
        made |= set(node.outputs)
    assert all(x in made for x in g.outputs)
    assert {i for i in f.problem.aliases.values()} <= set(range(f.problem.num_inputs))


def test_pins_that_differ_between_layers_keep_them_apart():
    p = gpt_problem(6)
    f = FO.fold(p)
    v, r = next((v, r) for v, r in _pairs(f) if len(p.strategies[v]) > 1)
    assert FO.fold(p, {v: 0, r: 0}).idx[v] == FO.fold(p, {v: 0, r: 0}).idx[r]
    apart = FO.fold(p, {v: 1, r: 0})
    assert apart is None or apart.idx[v] != apart.idx[r]


@pytest.mark.parametrize("engine", ["recursive", "dp", "data", "fsdp"])
def test_each_engine_searches_the_folded_problem_and_lifts_a_uniform_plan(engine):
    p = gpt_problem(6)
    f = FO.fold(p)
    res = search(p, engine, float("inf"))
    assert "6 x h (3 merged)" in res.solver_info[engine]["folded"]
    assert not res.solver_info[engine].get("optimal")  # uniform plans only: no optimality claim
    # the plan polished on the whole step may differ between copies; the engine's did not
    uniform = sum(res.choice[v] == res.choice[r] for v, r in _pairs(f))
    assert uniform >= 0.95 * len(_pairs(f))


def _pairs(f):
    rep = {}
    for v, k in enumerate(f.idx):
        rep.setdefault(int(k), v)
    return [(v, rep[int(k)]) for v, k in enumerate(f.idx) if rep[int(k)] != v]


def test_recursive_on_an_unrolled_gpt_trains_like_jax_jit():
    cfg = gpt.GPTConfig(**{**CFG.__dict__, "layers": 5})
    ts = gpt.make_train_step(cfg)
    step = autopar.parallelize(ts.step, mesh=MESH, engine="recursive", donate_argnums=())
    state, batch = ts.init(0), ts.batch(0)
    plan = step.plan(state, batch)
    assert "5 x h (2 merged)" in plan.search_info["recursive"]["folded"]
    assert plan.replicated_share() < 0.5
    got = step(state, batch)
    want = jax.jit(ts.step)(state, batch)
    # the key bias has no gradient (softmax ignores it): AdamW turns float noise into
    # O(lr) updates there (tests/test_layers.py), and into ~1e-5 ones on the key kernel
    no_key_bias = lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, x: 0 * x if "['k']['bias']" in jax.tree_util.keystr(path) else x, tree
    )
    assert_trees_close(no_key_bias(got), no_key_bias(want), rtol=1e-4, atol=3e-5)


def test_switched_off_the_engines_search_the_whole_problem(monkeypatch):
    monkeypatch.setattr(FO, "ENABLED", False)
    res = search(gpt_problem(6), "recursive", float("inf"))
    assert "folded" not in res.solver_info.get("recursive", {})


def test_a_folded_node_pays_d_recs_replication_penalty_once_per_copy():
    """D-Rec's cut penalty (bytes a cut leaves replicated) is per node, not a cost table:
    a folded node stands for its copies, so it pays it once per copy, as its time does
    (without this the folded D-Rec kept GPT-3 175B's optimizer state whole, 3.3% dearer)."""
    from autopar.search import engines

    p = gpt_problem(8)
    f = FO.fold(p)
    assert f.problem.copies.sum() == len(p.strategies)
    full, folded = engines._replication_penalty(p), engines._replication_penalty(f.problem)
    n_in = p.num_inputs
    k, m = next(
        (k, m)
        for k, m in enumerate(f.members)
        if len(m) > 1 and m[0] >= n_in and p.graph.nodes[m[0] - n_in].op == "dot_general"
    )
    assert full(m[0]).any()
    np.testing.assert_allclose(folded(k), len(m) * full(m[0]))


def test_dp_on_a_folded_problem_solves_it_as_the_quotient():
    """A folded problem has no layers left to merge, but dp guesses on it as on the
    quotient it is: the second solve (state bytes priced) and the cone rounds run, and
    the plan is the cheapest of them (without them, an 8-layer Llama-style step planned
    2.4% dearer folded than whole)."""
    from autopar.search import layers as LY

    f = FO.fold(gpt_problem(6))
    q = f.problem.cost_graph()
    got = LY.solve_dp_layered(f.problem, q)
    tried = {k: v for k, v in got.info["layers"]["starts"].items() if k != "cones_s" and v}
    assert {"free", "state_priced", "cones"} <= set(tried)
    assert got.cost == pytest.approx(min(tried.values()))
