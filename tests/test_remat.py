"""Rematerialization (`autopar.passes.remat`): a scanned layer loop's residuals recomputed
in the backward scan instead of stored by the forward one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close
from jax.sharding import Mesh

import cost_models
from autopar.api import make_plan
from autopar.cost.model import CostModel
from autopar.examples.models import gpt
from autopar.ir.capture import capture
from autopar.ir.graph import Graph, check_graph
from autopar.lower.jit import jit_from_plan
from autopar.passes.precision import graph_fn
from autopar.passes.remat import (
    POLICIES,
    SAVEABLE,
    Layout,
    body_flops,
    cheapest_contractions,
    choose_policy,
    remat,
    remat_report,
    residual_bytes,
    scan_pairs,
)
from autopar.search import search
from autopar.search.problem import build_problem
from autopar.sharding import mesh_info

SMALL = gpt.GPTConfig(
    hidden=64, heads=4, layers=4, seq=32, vocab=128, batch_size=8, scan_layers=True
)
LR = 1e-2  # gpt.make_train_step's default
BIG = gpt.GPTConfig(
    hidden=128, heads=4, layers=4, seq=128, vocab=256, batch_size=16, scan_layers=True
)


def lowered(graph: Graph, flat_args, devices: int, engine: str):
    """Run `graph` through autopar's search and lowering on a `devices`-device mesh."""
    shape = {1: (1, 1), 8: (4, 2)}[devices]
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(shape), ("data", "model"))
    profile = cost_models.load("cpu")
    info = mesh_info(mesh, profile.devices_per_node)
    problem = build_problem(graph, info, CostModel(profile, info))
    plan = make_plan(problem, search(problem, engine, float("inf")), profile, mesh)
    return jit_from_plan(graph, plan, mesh)(*flat_args)


def assert_step_close(got, want, paths, what: str) -> None:
    """Outputs at the float32 tolerance, except the updated parameters: Adam turns the
    noise-level gradients (the attention key bias's is zero in exact arithmetic) into
    steps of up to the learning rate, whatever order XLA sums them in (see
    tests/test_numerics.py); the moments and the loss still compare tightly."""
    for path, a, e in zip(paths, got, want, strict=True):
        tol = {"atol": 2 * LR} if path.startswith("out/0/params/") else {}
        assert_trees_close(a, e, what=f"{what}: {path}", **tol)


def pair_nodes(graph: Graph):
    (p,) = scan_pairs(graph)
    return graph.nodes[p.forward], graph.nodes[p.backward]


@pytest.fixture(scope="module")
def case():
    ts = gpt.make_train_step(SMALL)
    state, batch = jax.jit(ts.init)(0), ts.batch(0)
    graph = capture(ts.step, gpt.abstract_args(SMALL))
    flat = jax.tree.leaves((state, batch))
    want = jax.tree.leaves(jax.jit(ts.step)(state, batch))
    return graph, flat, want, {p: remat(graph, p) for p in ("dots", "selective", "full")}


def test_pairs_found(case):
    graph, *_ = case
    (p,) = scan_pairs(graph)
    f, b = graph.nodes[p.forward], graph.nodes[p.backward]
    assert f.op == b.op == "scan" and b.params["reverse"] and not f.params["reverse"]
    assert len(p.reads) > 20  # ~30 residuals of a GPT layer


@pytest.mark.parametrize("policy", ["dots", "selective", "full"])
def test_graph_invariants_and_purity(case, policy):
    graph, _, _, out = case
    before = str(graph)
    after = out[policy]
    assert after is not graph and str(graph) == before  # pure
    check_graph(after)
    assert (after.inputs, after.outputs) == (graph.inputs, graph.outputs)
    assert (after.input_paths, after.output_paths) == (graph.input_paths, graph.output_paths)
    assert after.values[: len(graph.values)] == graph.values  # new values appended
    assert [n.op for n in after.nodes] == [n.op for n in graph.nodes]
    for n in after.nodes:
        if n.body is None:
            continue
        check_graph(n.body)
        lay = Layout.of(n)
        closed = n.params["jaxpr"]
        assert len(closed.in_avals) == len(n.inputs) == len(n.body.inputs)
        assert len(closed.out_avals) == len(n.outputs) == len(n.body.outputs)
        assert [(a.shape, a.dtype) for a in closed.in_avals] == [
            (n.body.values[v].shape, n.body.values[v].dtype) for v in n.body.inputs
        ]
        assert len(n.body.input_paths) == len(n.body.inputs)
        assert n.body.input_paths[lay.xs_start - 1 : lay.xs_start + 1] == ("body/carry0", "body/x0")
        length = n.params["length"]
        for v, bv in zip(n.inputs[lay.xs_start :], n.body.inputs[lay.xs_start :]):
            assert after.values[v].shape == (length, *n.body.values[bv].shape)
        for v, bv in zip(n.outputs[lay.num_carry :], n.body.outputs[lay.num_carry :]):
            assert after.values[v].shape == (length, *n.body.values[bv].shape)
    assert remat(after, policy) is after  # nothing left to rematerialize


@pytest.mark.parametrize(("policy", "devices", "engine"), [("dots", 1, "data"), ("full", 8, "dp")])
def test_same_numbers_lowered(case, policy, devices, engine):
    graph, flat, want, out = case
    got = lowered(out[policy], flat, devices, engine)
    assert_step_close(got, want, graph.output_paths, f"remat {policy} on {devices} devices")


def test_same_numbers_unsharded(case):
    graph, flat, want, out = case
    for policy, g in out.items():
        assert_step_close(jax.jit(graph_fn(g))(*flat), want, graph.output_paths, policy)


def test_residuals_drop_and_backward_recomputes(case):
    graph, _, _, out = case
    f0, b0 = pair_nodes(graph)
    layer_in = f0.body.inputs[Layout.of(f0).num_consts]  # the forward carry input
    before = residual_bytes(graph)
    reports = {p: remat_report(graph, g, p) for p, g in out.items()}
    for policy, g in out.items():
        f, b = pair_nodes(g)
        lf = Layout.of(f)
        ys = f.body.outputs[lf.num_carry :]
        assert residual_bytes(g) < before
        assert body_flops(b.body) > body_flops(b0.body)
        r = reports[policy]
        (pr,) = r.pairs
        assert r.bytes_before == before and r.bytes_after == residual_bytes(g)
        assert pr.recompute_flops == pytest.approx(
            SMALL.layers * (body_flops(b.body) - body_flops(b0.body))
        )
        assert pr.bytes_per_layer_before * SMALL.layers == pr.bytes_before
        assert r.notes() and policy in r.notes()[0]
        if policy == "full":  # only the layer input is stored
            assert ys == (layer_in,)
            assert pr.residuals_after == 1
            assert r.bytes_after == SMALL.layers * f.body.values[layer_in].nbytes
        else:  # the layer input and contraction outputs
            producers = {f.body.producer.get(v) for v in ys} - {None}
            assert {f.body.nodes[i].op for i in producers} <= SAVEABLE
            assert set(ys) - {f.body.nodes[i].outputs[0] for i in producers} == {layer_in}
            dots = [n for n in b.body.nodes if n.op in SAVEABLE]
            repeated = len(dots) - sum(1 for n in b0.body.nodes if n.op in SAVEABLE)
            # "selective" repeats the attention scores' matmul; "dots" no contraction
            assert repeated == (policy == "selective")
    assert reports["full"].bytes_after < reports["selective"].bytes_after
    assert reports["selective"].bytes_after < reports["dots"].bytes_after < before
    assert reports["dots"].recompute_flops < reports["selective"].recompute_flops
    assert reports["selective"].recompute_flops < reports["full"].recompute_flops
    assert choose_policy(graph, float("inf")) == "none"
    assert choose_policy(graph, reports["dots"].bytes_after) == "dots"
    assert choose_policy(graph, reports["selective"].bytes_after) == "selective"
    assert choose_policy(graph, 0) == "full"


def test_selective_recomputes_the_attention_scores(case):
    """The contraction output cheapest to recompute per byte in a GPT layer is q @ k^T
    ([batch, heads, seq, seq]); "selective" stores every other matmul output."""
    graph, _, _, out = case
    f0, _ = pair_nodes(graph)
    scores = cheapest_contractions(f0.body)
    b, h, s = SMALL.batch_size, SMALL.heads, SMALL.seq
    assert [f0.body.values[v].shape for v in scores] == [(b, h, s, s)]
    f, _ = pair_nodes(out["selective"])
    fd, _ = pair_nodes(out["dots"])
    stored = {f.body.values[v].shape for v in f.body.outputs[Layout.of(f).num_carry :]}
    stored_dots = {fd.body.values[v].shape for v in fd.body.outputs[Layout.of(fd).num_carry :]}
    assert (b, h, s, s) in stored_dots and (b, h, s, s) not in stored


def test_graphs_without_pairs_unchanged():
    cfg = gpt.GPTConfig(hidden=32, heads=2, layers=2, seq=16, vocab=64, batch_size=4)
    unrolled = capture(gpt.make_train_step(cfg).step, gpt.abstract_args(cfg))
    forward_only = capture(
        lambda xs: jax.lax.scan(lambda c, x: (c * x, jnp.sin(c)), jnp.ones(3), xs),
        (jax.ShapeDtypeStruct((4, 3), np.float32),),
    )
    for g in (unrolled, forward_only):
        assert not scan_pairs(g)
        for policy in ("none", "dots", "full"):
            assert remat(g, policy) is g
        assert not remat_report(g, g).pairs
    assert remat(unrolled, "none") is unrolled
    with pytest.raises(ValueError, match="policy"):
        remat(unrolled, "everything")


def toy_step(w, b, h0):
    """A scanned toy network with two carries, a loop constant and per-layer weights,
    differentiated; it also returns the per-layer activations (read outside the loops)."""

    def loss(w, b, h0):
        def layer(carry, wl):
            h, acc = carry
            z = h @ wl + b
            h = jnp.tanh(z) * jax.nn.sigmoid(z)
            return (h, acc + jnp.sum(h * h)), jnp.exp(-z)

        (h, acc), zs = jax.lax.scan(layer, (h0, 0.0), w)
        return jnp.sum(h) + acc, zs

    (value, zs), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(w, b, h0)
    return value, zs, grads


def test_toy_loop_with_two_carries():
    args = (
        jax.random.normal(jax.random.key(0), (3, 8, 8)) / 3,
        jnp.linspace(-1, 1, 8),
        jax.random.normal(jax.random.key(1), (4, 8)),
    )
    graph = capture(toy_step, args)
    (p,) = scan_pairs(graph)
    want = jax.tree.leaves(jax.jit(toy_step)(*args))
    for policy in ("dots", "full"):
        g = remat(graph, policy)
        check_graph(g)
        assert residual_bytes(g) < residual_bytes(graph)
        assert_trees_close(list(jax.jit(graph_fn(g))(*args)), want, what=policy)
        assert remat(g, policy) is g
    f = remat(graph, "full").nodes[p.forward]
    # the stored h is the layer input; zs (a graph output) stays stored
    assert len(f.outputs) - Layout.of(f).num_carry == 2


def two_loops_step(w1, w2, h0):
    """Two scanned stacks in a row: two forward/backward pairs."""

    def stack(h, w):
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl) * h, None), h, w)[0]

    return jax.grad(lambda w1, w2: jnp.sum(jnp.sin(stack(stack(h0, w1), w2))), (0, 1))(w1, w2)


def test_several_pairs():
    keys = jax.random.split(jax.random.key(2), 3)
    args = (
        jax.random.normal(keys[0], (3, 8, 8)) / 3,
        jax.random.normal(keys[1], (2, 8, 8)) / 3,
        jax.random.normal(keys[2], (4, 8)),
    )
    graph = capture(two_loops_step, args)
    assert len(scan_pairs(graph)) == 2
    want = jax.tree.leaves(jax.jit(two_loops_step)(*args))
    for policy in ("dots", "full"):
        g = remat(graph, policy)
        report = remat_report(graph, g, policy)
        assert len(report.pairs) == 2 and all(p.saved_bytes > 0 for p in report.pairs)
        assert_trees_close(list(jax.jit(graph_fn(g))(*args)), want, what=policy)


def compiled_temp_bytes(graph: Graph) -> int:
    args = [
        jax.ShapeDtypeStruct(graph.values[v].shape, graph.values[v].dtype) for v in graph.inputs
    ]
    compiled = jax.jit(graph_fn(graph)).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_compiled_memory_drops():
    graph = capture(gpt.make_train_step(BIG).step, gpt.abstract_args(BIG))
    temp = {p: compiled_temp_bytes(remat(graph, p)) for p in POLICIES}
    saved = {p: residual_bytes(remat(graph, p)) for p in POLICIES}
    print(f"temp bytes {temp}; stored residual bytes {saved}")
    assert temp["full"] < temp["selective"] < temp["dots"] < temp["none"]
    # XLA keeps the stored residual stacks alive between the loops: the drop is theirs
    assert temp["none"] - temp["full"] >= 0.5 * (saved["none"] - saved["full"])


def test_parallelize_remat_trains_and_replays(tmp_path):
    """`parallelize(remat=...)`: a sharded scanned GPT with its residuals recomputed
    trains like `jax.jit`, and the plan file replays the policy."""
    from helpers import replay_from_file, run_steps

    import autopar

    cfg = gpt.GPTConfig(
        hidden=64, heads=4, seq=32, vocab=256, layers=4, batch_size=8, scan_layers=True
    )
    ts = gpt.make_train_step(cfg)
    state = jax.jit(ts.init)(0)
    mesh = {"data": 2, "model": 4}
    step = autopar.parallelize(ts.step, mesh=mesh, cluster="cpu", remat="full")
    losses, _ = run_steps(step, state, ts.batch, 2)
    ref, _ = run_steps(jax.jit(ts.step), state, ts.batch, 2)
    assert_trees_close(losses, ref, what="losses")
    args = (state, ts.batch(0))
    plan = step.plan(*args)
    assert plan.remat == "full" and any(w.startswith("remat (full)") for w in plan.warnings)
    assert replay_from_file(step, ts.step, args, tmp_path, mesh=mesh, cluster="cpu").remat == "full"


def test_remat_auto_picks_a_policy_that_fits():
    """ "auto" moves to a rematerializing policy when the budget leaves no room for the
    residuals, and says which policies it tried."""
    import autopar
    from autopar.api import compiled_memory

    cfg = gpt.GPTConfig(
        hidden=64, heads=4, seq=32, vocab=256, layers=4, batch_size=8, scan_layers=True
    )
    ts = gpt.make_train_step(cfg)
    args = gpt.abstract_args(cfg)
    mesh = {"data": 2, "model": 4}
    # a budget under what the plan without remat needs once compiled (at this size
    # XLA:CPU's own buffers are a large part of it, so the cost model's figure is not
    # the bar: parallelize compiles plans near the budget to check them)
    plain = autopar.parallelize(ts.step, mesh=mesh, cluster="cpu")
    budget = 0.9 * compiled_memory(plain.lower(*args).compile())
    auto = autopar.parallelize(
        ts.step, mesh=mesh, cluster="cpu", remat="auto", memory_budget=budget
    ).plan(*args)
    assert auto.remat in ("dots", "selective", "full") and auto.cost.peak_memory_bytes <= budget
    assert auto.compiled_memory_bytes is None or auto.compiled_memory_bytes <= budget
    assert any(w.startswith("remat='auto' tried remat=none: ") for w in auto.warnings)


def _toy_step(checkpoint: bool):
    """Four unrolled layers, each under `jax.checkpoint` when asked, and an SGD step."""

    def layer(w, x):
        h = jnp.tanh(x @ w[0])
        h = jnp.sin(h) * jnp.cos(h) + jnp.exp(-h * h)
        return jnp.tanh(h @ w[1]) + x

    f = jax.checkpoint(layer) if checkpoint else layer

    def loss(ws, x):
        for w in ws:
            x = f(w, x)
        return jnp.mean(x**2)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return value, jax.tree.map(lambda a, b: a - 0.1 * b, ws, grads)

    return step


def test_user_checkpoint_of_unrolled_layers_is_kept():
    """A user's `jax.checkpoint` (here on layers unrolled in Python, which the remat pass
    does not touch) survives capture: the lowered program has optimization barriers
    (one per value, jax.jit one for all) and jax.jit's recomputed matmuls, and the
    predicted peak counts only what is kept."""
    import re

    import autopar

    ws = [jnp.stack([jnp.eye(64) * 0.5, jnp.eye(64) * 0.5]) + 0.01 * i for i in range(4)]
    x = jnp.linspace(-1, 1, 256 * 64).reshape(256, 64)
    peaks, dots = {}, {}
    for ck in (False, True):
        step = _toy_step(ck)
        par = autopar.parallelize(step, mesh={"data": 1}, cluster="cpu")
        ours, ref = par.lower(ws, x), jax.jit(step).lower(ws, x)
        barriers = ref.as_text().count("optimization_barrier")
        # one barrier per value the recomputation reads, where jax.jit has one for all
        assert (ours.as_text().count("optimization_barrier") >= barriers > 0) == ck
        count = lambda lowered: len(re.findall(r" dot\(", lowered.compile().as_text()))
        dots[ck] = count(ours)
        assert dots[ck] == count(ref)
        peaks[ck] = par.plan(ws, x).cost.peak_memory_bytes
        assert_trees_close(par(ws, x), jax.jit(step)(ws, x))
    assert dots[True] == dots[False] + 4  # each layer's first matmul runs again backward
    assert peaks[True] < 0.5 * peaks[False]


def test_remat_auto_tries_more_remat_when_a_faster_plan_was_over_the_budget():
    """A plan that fits, found while a faster one was over the budget, was held back by
    memory: `remat="auto"` goes on to the policies that recompute (a trial's 8B step
    kept remat=none's plan at 1385 ms, 98% of the budget, where dots gave 941 ms). The
    mesh is larger than this machine's devices, so nothing is compile-checked."""
    import warnings

    import autopar

    cfg = gpt.GPTConfig(
        hidden=256, heads=4, seq=128, vocab=512, layers=4, batch_size=32, scan_layers=True
    )
    ts = gpt.make_train_step(cfg)
    args = gpt.abstract_args(cfg)
    mesh = {"data": 4, "model": 4}
    free = autopar.parallelize(ts.step, mesh=mesh, cluster="a100-80g", progress=False)
    costs = list(free.plan(*args).candidates.values())
    fastest = min(costs, key=lambda c: c.step_s)
    smaller = [c for c in costs if c.peak_memory_bytes < fastest.peak_memory_bytes]
    assert smaller, costs
    budget = (fastest.peak_memory_bytes + max(c.peak_memory_bytes for c in smaller)) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not compile-checked: no devices for the mesh
        auto = autopar.parallelize(
            ts.step, mesh=mesh, cluster="a100-80g", remat="auto", memory_budget=budget,
            progress=False,
        ).plan(*args)  # fmt: skip
    (note,) = [w for w in auto.warnings if w.startswith("remat='auto' tried ")]
    assert "remat=none: " in note and "remat=dots: " in note, note
