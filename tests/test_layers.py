"""Repeated layers solved once (autopar/search/layers.py)."""

import functools

import jax
import numpy as np
import pytest
from helpers import assert_trees_close

import autopar
import cost_models
from autopar.cost.model import CostModel
from autopar.examples.models import gpt
from autopar.ir.capture import capture
from autopar.search import layers as LY
from autopar.search import search
from autopar.search.problem import build_problem
from autopar.search.solvers.costgraph import CostGraph
from autopar.search.solvers.dp import solve_dp
from autopar.sharding import MeshInfo

MESH = {"data": 2, "model": 2}
CFG = gpt.GPTConfig(vocab=128, seq=16, hidden=32, layers=4, heads=2, batch_size=8)


@functools.cache
def gpt_problem(layers: int = 4):
    cfg = gpt.GPTConfig(**{**CFG.__dict__, "layers": layers})
    ts = gpt.make_train_step(cfg)
    graph = capture(ts.step, gpt.abstract_args(cfg))
    profile = cost_models.load("h100-sxm")
    mesh = MeshInfo.build(tuple(MESH), tuple(MESH.values()), None, profile.devices_per_node)
    return build_problem(graph, mesh, CostModel(profile, mesh))


def layer_of(problem, v):
    """The h_<i> a cost-graph node's name says it belongs to (None for unnamed ops)."""
    g = problem.graph
    name = (
        g.input_paths[v] if v < problem.num_inputs else g.nodes[v - problem.num_inputs].name_stack
    )
    for seg in name.split("/"):
        seg = seg.rstrip(")").rpartition("(")[2]
        if seg.startswith("h_") and seg[2:].isdigit():
            return int(seg[2:])
    return None


def test_detects_the_blocks_of_a_small_gpt():
    p = gpt_problem()
    lay = LY.find_layers(p)
    assert lay.groups == {
        "h": {
            "layers": 4,
            "kept": [0, 1, 3],
            "representative": 1,
            "merged": 1,
            "nodes_per_layer": lay.groups["h"]["nodes_per_layer"],
        }
    }
    moved = np.flatnonzero(lay.phi != np.arange(len(lay.phi)))
    assert len(moved) == lay.groups["h"]["nodes_per_layer"] == lay.merged
    named = [v for v in moved if layer_of(p, v) is not None]
    # Every named node of h_2 (forward, backward, params, mu, nu) is merged into h_1,
    # position by position: same op, same strategies.
    assert {layer_of(p, v) for v in named} == {2}
    assert len(named) == sum(layer_of(p, v) == 2 for v in range(len(lay.phi)))
    for v in moved:
        r = int(lay.phi[v])
        assert layer_of(p, r) in (1, None)
        assert p.strategies[v] == p.strategies[r]
        if v >= p.num_inputs:
            a, b = p.graph.nodes[v - p.num_inputs], p.graph.nodes[r - p.num_inputs]
            assert a.op == b.op and a.name_stack.replace("h_2", "h_1") == b.name_stack
    # The unnamed optimizer ops of h_2 were merged too (they follow their parameters).
    assert len(named) < len(moved)


def test_no_repeated_layers_means_plain_dp():
    """Nothing merged: plain dp on the whole graph, polished as long as a quotient."""
    p = gpt_problem(layers=2)
    assert LY.find_layers(p).merged == 0
    g = p.cost_graph()
    assert LY.solve_dp_layered(p, g).choice == solve_dp(g, polish=LY.POLISH).choice


def test_quotient_prices_every_lifted_plan_exactly():
    p = gpt_problem()
    g = p.cost_graph()
    lay = LY.find_layers(p)
    q, idx = LY.quotient(g, lay.phi)
    assert q.num_nodes() == g.num_nodes() - lay.merged
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = [int(rng.integers(len(c))) for c in q.node_cost]
        lifted = [x[k] for k in idx]
        assert g.total(lifted) == pytest.approx(q.total(x), rel=1e-12)
        assert g.memory(lifted) == pytest.approx(q.memory(x), rel=1e-12)


def test_quotient_sums_copies_and_folds_self_edges():
    # 0 - 1 - 2 - 3 with nodes 2 merged into 1 and 3 into itself: edge 1-2 becomes
    # node 1's diagonal, edge 2-3 becomes 1-3.
    c = [np.array([1.0, 2.0]), np.array([0.0, 5.0]), np.array([3.0, 0.0]), np.array([1.0, 1.0])]
    m = np.array([[0.0, 7.0], [7.0, 0.5]])
    g = CostGraph(tuple(c), tuple(np.ones(2) for _ in c), {(0, 1): m, (1, 2): m, (2, 3): 2 * m})
    q, idx = LY.quotient(g, np.array([0, 1, 1, 3]))
    assert list(idx) == [0, 1, 1, 2]
    np.testing.assert_allclose(q.node_cost[1], [0.0 + 3.0 + 0.0, 5.0 + 0.0 + 0.5])
    np.testing.assert_allclose(q.edges[(1, 2)], 2 * m)
    np.testing.assert_allclose(q.node_mem[1], [2.0, 2.0])
    for x in np.ndindex(2, 2, 2):
        assert g.total([x[k] for k in idx]) == pytest.approx(q.total(list(x)))


def test_reduced_dp_plan_is_uniform_and_as_good_as_full_dp():
    p = gpt_problem()
    g = p.cost_graph()
    red = LY.solve_dp_layered(p, g)
    full = solve_dp(g)
    lay = LY.find_layers(p)
    assert all(red.choice[v] == red.choice[int(lay.phi[v])] for v in range(len(red.choice)))
    assert red.cost == pytest.approx(g.total(red.choice))
    # Of its two solves (free, state bytes priced) the cheaper one under the true costs.
    assert red.cost == pytest.approx(min(red.info["layers"]["starts"].values()), rel=1e-9)
    assert red.info["layers"]["reduced_nodes"] == g.num_nodes() - lay.merged
    assert not red.optimal
    # dp guesses a kernel on GPT graphs either way; the reduced graph is polished longer.
    # Measured on this graph: reduced 0.73x the full dp's objective, 0.94x a full dp
    # polished as long (polish=POLISH).
    assert red.cost <= 1.02 * full.cost, (red.cost, full.cost)


def test_a_layer_pinned_differently_is_not_merged():
    p = gpt_problem()
    lay = LY.find_layers(p)
    v = int(np.flatnonzero(lay.phi != np.arange(len(lay.phi)))[0])
    pins = {v: len(p.strategies[v]) - 1, int(lay.phi[v]): 0}
    assert len(p.strategies[v]) > 1
    assert LY.find_layers(p, pins).merged == 0
    same = {v: 0, int(lay.phi[v]): 0}
    assert LY.find_layers(p, same).merged == lay.merged


def test_dp_engine_uses_the_reduction_and_lowers_correctly():
    step = autopar.parallelize(
        gpt.make_train_step(CFG).step, mesh=MESH, engine="dp", donate_argnums=()
    )
    ts = gpt.make_train_step(CFG)
    state, batch = ts.init(0), ts.batch(0)
    plan = step.plan(state, batch)
    # Every op of h_2 took the strategy of the same op in h_1.
    h1 = [(o.op, o.strategy) for o in plan.ops if "/h_1/" in o.key]
    h2 = [(o.op, o.strategy) for o in plan.ops if "/h_2/" in o.key]
    assert h1 and h1 == h2
    got = step(state, batch)
    want = jax.jit(ts.step)(state, batch)
    # The key bias has no gradient (softmax ignores it): AdamW turns float noise into
    # O(lr) updates of either sign there, on one device as on many. Compare the rest.
    no_key_bias = lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, x: 0 * x if "['k']['bias']" in jax.tree_util.keystr(path) else x, tree
    )
    assert_trees_close(no_key_bias(got), no_key_bias(want), rtol=1e-4, atol=1e-5)


def test_search_driver_reports_the_reduction():
    p = gpt_problem()
    res = search(p, "dp", float("inf"))
    lay = LY.find_layers(p)
    assert all(res.choice[v] == res.choice[int(lay.phi[v])] for v in range(len(res.choice)))


def test_layers_of_a_model_written_without_modules_are_merged():
    """A decoder written as plain functions (no modules: its ops' names are jnp's scopes,
    einsum specs, `_where`, `tril`), its blocks in `params["layers"]`: the attention ops
    between a layer's weights join that layer, so every middle layer folds into one."""
    import jax.numpy as jnp

    L, d, S, B, V = 6, 32, 16, 4, 64
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731

    def layer(x, p):
        q, k, v = (jnp.einsum("bsd,de->bse", x, p[w]) for w in ("wq", "wk", "wv"))
        s = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(d)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
        x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v) @ p["wo"]
        return x + jax.nn.silu(x @ p["w1"]) @ p["w2"]

    def step(params, tokens):
        def loss(params):
            x = params["embed"][tokens]
            for p in params["layers"]:
                x = layer(x, p)
            return jnp.mean((x @ params["head"]) ** 2)

        g = jax.grad(loss)(params)
        return jax.tree.map(lambda w, gw: w - 0.1 * gw, params, g)

    block = {w: sds(d, d) for w in ("wq", "wk", "wv", "wo")} | {
        "w1": sds(d, 4 * d),
        "w2": sds(4 * d, d),
    }
    params = {"embed": sds(V, d), "layers": [block] * L, "head": sds(d, V)}
    graph = capture(step, (params, jax.ShapeDtypeStruct((B, S), jnp.int32)))
    profile = cost_models.load("h100-sxm")
    mesh = MeshInfo.build(tuple(MESH), tuple(MESH.values()), None, profile.devices_per_node)
    p = build_problem(graph, mesh, CostModel(profile, mesh))
    lay = LY.find_layers(p)
    assert lay.groups["layers"]["merged"] == L - 3, lay.groups  # all but 0, 1 and L-1
    labels = LY._label(p, LY.KEEP)
    # the attention core reads only its own layer's values: all of it is labelled (ops
    # reading the residual stream touch two layers and stay global, as they should)
    core = [
        v
        for v in range(p.num_inputs, len(labels))
        if "bqd,bkd->bqk" in p.graph.nodes[v - p.num_inputs].name_stack
    ]
    assert len(core) >= 2 * L and all(labels[v] is not None for v in core)


def test_a_rolled_loop_body_folds_every_layer_slot():
    """Layers unrolled in Python and rolled into loops over 2 stages: each loop body runs
    k = 4 layers. Named after the first stage's layers, the forward ops remat copies
    into the backward body and that body's own ops label slot j alike, and a loop body
    keeps no end layers distinct (it has no embedding or head), so `dp` folds the k slots
    into one or two (the last slot's boundary ops may label differently) and searches the
    body flat in depth, like a scanned model's one-layer body."""
    import warnings

    import autopar
    from autopar import examples
    from autopar.search.layouts import data_pins

    w = examples.gpt(hidden=32, layers=8, heads=2, seq=16, vocab=64, batch=8)
    par = autopar.parallelize(
        w.fn,
        mesh={"stage": 2, "data": 2, "model": 2},
        pipeline_stages=2,
        microbatches=2,
        remat="full",
        engine="dp",
        donate_argnums=w.donate_argnums,
        cache_dir=False,
        progress=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        par.plan(*w.args)
    (compiled,) = par._cache.values()
    assert compiled.roll is not None and compiled.plan.remat == "full"
    bodies = [b for b, _ in compiled.problem.bodies.values()]
    assert len(bodies) == 2 and all(b.loop_body for b in bodies)
    for body in bodies:
        lay = LY.find_layers(body, {}, keep=0)
        (group,) = lay.groups.values()
        # slots 1..k-1 fold into slot 0, but for the last where the body's boundary
        # labels an op or two differently: two layers are left whatever k is
        assert group["layers"] == 4 and group["merged"] >= 2, group
        per = group["nodes_per_layer"]
        left = len(body.strategies) - lay.merged
        assert left <= 2 * per + body.num_inputs + per // 4, (left, per, body.num_inputs)
    # the optimizer's per-layer ops outside the loops are named by slot, so they fold too
    outer = LY.find_layers(compiled.problem, data_pins(compiled.problem))
    assert any(k.startswith("rolled_layers_slot") for k in outer.groups), outer.groups


def test_inspect_places_a_plain_functions_ops_in_its_layers_not_its_state_tuple():
    """A plain-JAX step over `state = (params, opt_state)`: `state/0` and `state/1` are
    indexed like layers but hold different leaves; taken for a family of two, every
    op went under `state/0` or `state/1` and the layers showed 0 ops (a trial's 8B
    Llama: 11,217 ops under `state/0`)."""
    import jax.numpy as jnp
    import optax

    from autopar.plan.plan import Plan
    from autopar.tools.inspect.report import layer_rows

    tx = optax.adam(1e-2)
    params = {"layers": [{"w": jnp.ones((32, 32)) / 32} for _ in range(6)]}

    def step(state, x):
        params, opt_state = state

        def loss(p):
            h = x
            for layer in p["layers"]:
                h = h + jnp.tanh(h @ layer["w"])
            return jnp.mean(h**2)

        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    x = jnp.sin(jnp.arange(64 * 32.0)).reshape(64, 32)
    plan = autopar.parallelize(step, mesh={"data": 2, "model": 4}).plan(
        (params, tx.init(params)), x
    )
    rows = {d["layer"]: d for d in layer_rows(Plan.from_json(plan.to_json()))}
    assert not any(k.startswith("state/") for k in rows), rows.keys()
    assert min(rows[f"layers/{i}"]["ops"] for i in range(6)) > 0, rows


def test_inspect_places_an_nnx_models_ops_in_its_layers():
    """NNX modules add no name scopes to the ops they trace, so every op's key names no
    layer; the plan records the layer the search placed each op in (`OpRecord.layer`),
    and `inspect --by layer` shows the ops under their layers (it listed all of them
    under "(top level)", saying the model was written without modules)."""
    import jax.numpy as jnp
    from flax import nnx

    from autopar.plan.plan import Plan
    from autopar.tools.inspect.report import layer_rows

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Block(rngs) for _ in range(6)])
            self.head = nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):
            for block in self.layers:
                x = block(x)
            return self.head(x)

    graphdef, params = nnx.split(Net(nnx.Rngs(0)))

    def step(params, x):
        def loss(p):
            return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)

        return jax.tree.map(lambda w, g: w - 0.1 * g, params, jax.grad(loss)(params))

    x = jnp.sin(jnp.arange(64 * 32.0)).reshape(64, 32)
    plan = autopar.parallelize(step, mesh={"data": 2, "model": 4}).plan(params, x)
    rows = {d["layer"]: d for d in layer_rows(Plan.from_json(plan.to_json()))}
    middle = [rows[f"layers/{i}"]["ops"] for i in range(1, 5)]
    assert min(middle) > 0 and len(set(middle)) == 1, rows.keys()
    assert rows["(top level)"]["ops"] < sum(middle), rows["(top level)"]


def test_diff_folds_layers_whose_changes_repeat():
    """`autopar diff` listed every layer's changes, identical from layer to layer (1,600
    lines for a 4-layer model): a layer whose changed arrays and ops repeat an earlier
    layer's (its name and op counters aside) is folded into it, its group says which."""
    import re

    import jax.numpy as jnp

    from autopar.plan.plan import Plan
    from autopar.tools.inspect.diff import diff_plans, render_diff

    params = {"layers": [{"w": jnp.ones((64, 64)) / 64} for _ in range(6)]}

    def step(params, x):
        def loss(p):
            h = x
            for layer in p["layers"]:
                h = h + jnp.tanh(h @ layer["w"])
            return jnp.mean(h**2)

        return jax.tree.map(lambda w, g: w - 0.1 * g, params, jax.grad(loss)(params))

    x = jnp.sin(jnp.arange(64 * 64.0)).reshape(64, 64)
    a, b = (
        Plan.from_json(autopar.parallelize(step, mesh=8, engine=e).plan(params, x).to_json())
        for e in ("data", "fsdp")
    )
    d = diff_plans(a, b)
    assert len({c["layer"] for c in d["inputs"]["changed"]}) == 6, d["inputs"]["changed"]
    text = render_diff(d, "a", "b")
    inputs = text.split("== inputs", 1)[1].split("== outputs", 1)[0]
    assert re.search(r"\[layers/\d \(and \d alike: layers/\d", inputs), inputs
    assert inputs.count("[layers/") < 6, inputs
