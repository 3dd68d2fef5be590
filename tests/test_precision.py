"""Mixed precision (`autopar.passes.precision`): bfloat16 or float16 contractions, float32 master weights."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close
from jax import lax
from jax.sharding import Mesh

import cost_models
from autopar.api import make_plan
from autopar.cost.model import CostModel, compute_dtype, node_flops
from autopar.examples.models import gpt, mlp
from autopar.examples.models.common import simple_train_step
from autopar.ir.capture import capture
from autopar.ir.graph import Graph, check_graph
from autopar.lower.jit import jit_from_plan
from autopar.passes.precision import (
    CONTRACTIONS,
    describe,
    graph_fn,
    is_range_scale,
    mixed_precision,
    scaled_cast,
    upcast_operands,
)
from autopar.search import search
from autopar.search.problem import build_problem
from autopar.sharding import mesh_info

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
LR = 1e-2
CFG = mlp.MLPConfig(batch_size=16, din=32, hidden=64, dout=8, layers=1)
MATMUL = (((1,), (0,)), ((), ()))


@jax.custom_vjp
def bf16_matmul(x, w):
    """`x @ w` on bfloat16 operands, accumulated in float32; so is its backward."""
    return lax.dot_general(x.astype(BF16), w.astype(BF16), MATMUL, preferred_element_type=F32)


def _fwd(x, w):
    return bf16_matmul(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    dx = lax.dot_general(
        g.astype(BF16), w.astype(BF16), (((1,), (1,)), ((), ())), preferred_element_type=F32
    )
    dw = lax.dot_general(
        x.astype(BF16), g.astype(BF16), (((0,), (0,)), ((), ())), preferred_element_type=F32
    )
    return dx, dw


bf16_matmul.defvjp(_fwd, _bwd)


def bf16_dot_general(x, w, dimension_numbers, precision=None, preferred_element_type=None):
    assert dimension_numbers == MATMUL
    return bf16_matmul(x, w)


class MLP(nn.Module):
    """`mlp.MLP` with a pluggable dot (flax's `dot_general` hook)."""

    dot: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot is None else {"dot_general": self.dot}
        x = nn.relu(nn.Dense(CFG.hidden, name="dense_0", **kw)(x))
        return nn.Dense(CFG.dout, name="out", **kw)(x)


def train_step(dot=None):
    model = MLP(dot)

    def loss_fn(params, batch):
        return jnp.mean(jnp.square(model.apply({"params": params}, batch["x"]) - batch["y"]))

    def init_params(seed):
        return model.init(jax.random.key(seed), jnp.zeros((CFG.batch_size, CFG.din)))["params"]

    return simple_train_step(
        "mlp", loss_fn, init_params, functools.partial(mlp.make_batch, CFG), LR
    )


def lowered(graph: Graph, flat_args):
    """Run `graph` through autopar's lowering under a one-device (replicated) plan."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    profile = cost_models.load("cpu")
    info = mesh_info(mesh, profile.devices_per_node)
    problem = build_problem(graph, info, CostModel(profile, info))
    plan = make_plan(problem, search(problem, "data", float("inf")), profile, mesh)
    return jit_from_plan(graph, plan, mesh)(*flat_args)


def contractions(graph: Graph):
    """(graph, node) of every contraction, scan bodies included."""
    for n in graph.nodes:
        if n.body is not None:
            yield from contractions(n.body)
        elif n.op in CONTRACTIONS:
            yield graph, n


def assert_converted(before: Graph, after: Graph) -> None:
    """Every float32 contraction reads fresh bfloat16 casts and returns float32; every
    other value keeps its type; inputs/outputs untouched; invariants hold."""
    check_graph(after)
    assert after.inputs == before.inputs and after.outputs == before.outputs
    assert after.values[: len(before.values)] == before.values
    assert [after.values[v] for v in after.inputs] == [before.values[v] for v in before.inputs]
    casts = {v for n in after.nodes if n.op == "convert_element_type" for v in n.outputs}
    new = set(range(len(before.values), len(after.values)))
    assert new <= casts
    for v in new:
        assert after.values[v].dtype == BF16
    for n in after.nodes:
        if n.body is not None:
            assert_converted(before.nodes[before.producer[n.outputs[0]]].body, n.body)
        if n.op not in CONTRACTIONS:
            continue
        assert all(after.values[v].dtype == BF16 for v in n.inputs), n.key
        assert all(after.values[v].dtype == F32 for v in n.outputs), n.key
        assert np.dtype(n.params["preferred_element_type"]) == F32
        for v in n.inputs:  # a cast made just for this contraction, with its location
            cast = after.nodes[after.producer[v]]
            assert cast.op == "convert_element_type" and cast.id < n.id
            assert (cast.name_stack, cast.source) == (n.name_stack, n.source)
            assert after.values[cast.inputs[0]].dtype == F32


@pytest.fixture(scope="module")
def mlp_case():
    ts, ref = train_step(), train_step(bf16_dot_general)
    state, batch = ts.init(0), ts.batch(0)
    graph = capture(ts.step, (state, batch))
    return ts, ref, state, batch, graph, mixed_precision(graph)


def test_mlp_graph_converted_and_pure(mlp_case):
    _, _, _, _, graph, mixed = mlp_case
    before = str(graph)
    assert_converted(graph, mixed)
    assert str(graph) == before  # the pass did not touch its input
    assert not list(c for c in contractions(graph) if c[1].params["preferred_element_type"])
    # 2 forward dots, 2 weight gradients, 1 input gradient (the first layer's is dead)
    report = describe(graph)
    assert report.converted == report.converted_per_call == 5 == sum(1 for _ in contractions(mixed))
    assert report.saved_bytes * 2 == report.operand_bytes > 0
    assert "5 contractions" in report.notes()[0]
    assert describe(mixed).converted == 0  # idempotent: nothing float32 left
    assert mixed_precision(mixed) is mixed


def test_mlp_matches_hand_written_bf16_and_f32(mlp_case):
    ts, ref, state, batch, _, mixed = mlp_case
    flat = jax.tree.leaves((state, batch))
    out_tree = jax.tree.structure(jax.eval_shape(ts.step, state, batch))
    got = jax.tree.unflatten(out_tree, lowered(mixed, flat))
    new_state, metrics = got
    # float32 master weights and optimizer state, float32 loss
    for leaf in jax.tree.leaves(got):
        assert leaf.dtype in (F32, np.dtype(np.int32)), leaf.dtype
    # the same step written by hand with bfloat16 dot operands (forward and backward)
    assert_trees_close(got, jax.jit(ref.step)(state, batch), rtol=1e-5, atol=1e-6, what="vs bf16")
    # the float32 step, to bfloat16 accuracy
    want_state, want_metrics = jax.jit(ts.step)(state, batch)
    assert_trees_close(metrics, want_metrics, rtol=1e-2, atol=1e-3, what="loss vs f32")
    assert_trees_close(
        new_state["opt_state"][0].mu, want_state["opt_state"][0].mu, rtol=2e-2, atol=1e-4
    )
    # Adam's first step is about lr * sign(grad): where a gradient is ~0, bf16 may flip it
    assert_trees_close(new_state["params"], want_state["params"], rtol=0, atol=2.1 * LR)
    assert not np.allclose(metrics["loss"], want_metrics["loss"], rtol=1e-7, atol=0)


@pytest.fixture(scope="module")
def gpt_case():
    cfg = gpt.GPTConfig(
        hidden=32, heads=2, layers=2, seq=16, vocab=64, batch_size=4, scan_layers=True
    )
    ts = gpt.make_train_step(cfg)
    state, batch = jax.eval_shape(ts.init, 0), ts.batch(0)
    graph = capture(ts.step, (state, jax.eval_shape(lambda: batch)))
    return ts, graph, mixed_precision(graph)


def test_scan_gpt_converts_dots_inside_the_body(gpt_case):
    _, graph, mixed = gpt_case
    assert_converted(graph, mixed)
    scans = [n for n in mixed.nodes if n.body is not None]
    assert scans, "GPTConfig(scan_layers=True) should capture a scan"
    in_body = [n for s in scans for n in s.body.nodes if n.op == "dot_general"]
    assert in_body and all(
        s.body.values[n.inputs[0]].dtype == BF16
        for s in scans
        for n in s.body.nodes
        if n.op == "dot_general"
    )
    for s in scans:  # the node's jaxpr is the converted body: binding it computes the same
        eqns = s.params["jaxpr"].jaxpr.eqns
        dots = [e for e in eqns if e.primitive.name == "dot_general"]
        assert dots and all(e.invars[0].aval.dtype == BF16 for e in dots)
        assert [a.dtype for a in s.params["jaxpr"].in_avals] == [
            s.body.values[v].dtype for v in s.body.inputs
        ]
    report = describe(graph)
    assert any(c.scope for c in report.conversions)
    assert report.converted_per_call > report.converted  # body dots run once a layer


@pytest.mark.slow
def test_scan_gpt_numerics(gpt_case):
    ts, _, mixed = gpt_case
    state, batch = jax.jit(ts.init)(0), ts.batch(0)
    flat = jax.tree.leaves((state, batch))
    got = jax.jit(graph_fn(mixed, upcast_contractions=True))(*flat)
    want = jax.tree.leaves(jax.jit(ts.step)(state, batch))
    assert_trees_close(got[-1], want[-1], rtol=1e-2, atol=1e-3, what="loss")


def matmul_graph(n: int = 2048) -> Graph:
    """A compute-bound float32 matmul, traced on abstract arguments."""
    sds = jax.ShapeDtypeStruct((n, n), F32)
    return capture(lambda a, b: jnp.tanh(a @ b), (sds, sds))


def h100_cost() -> CostModel:
    profile = cost_models.load("h100-sxm")
    assert profile.flops_for(BF16) > 10 * profile.flops_for(F32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return CostModel(profile, mesh_info(mesh, profile.devices_per_node))


def test_cost_prices_bf16_dots_at_bf16_rate(mlp_case):
    cost = h100_cost()

    def dot_seconds(g: Graph) -> float:
        total = 0.0
        for gr, n in contractions(g):
            nbytes = sum(gr.values[v].nbytes for v in (*n.inputs, *n.outputs))
            total += cost.compute_seconds(node_flops(n, gr), nbytes, compute_dtype(n, gr))
        return total

    for graph in (mlp_case[4], matmul_graph()):
        mixed = mixed_precision(graph)
        assert all(compute_dtype(n, mixed) == BF16 for _, n in contractions(mixed))
        assert all(compute_dtype(n, graph) == F32 for _, n in contractions(graph))
        assert dot_seconds(mixed) < dot_seconds(graph)
    # compute-bound: the bf16 tensor-core rate, not just the halved operand bytes
    assert dot_seconds(mixed_precision(matmul_graph())) < dot_seconds(matmul_graph()) / 5


def test_problem_prices_converted_dots_lower():
    cost = h100_cost()

    def dot_time(g: Graph) -> float:
        p = build_problem(g, cost.mesh, cost)
        n_in = len(g.inputs)
        return sum(p.node_time[n_in + n.id][0] for n in g.nodes if n.op in CONTRACTIONS)

    graph = matmul_graph()
    # float32 dots run as TF32 by default (2x bf16's time on h100); asked for full
    # float32 precision they run on the CUDA cores (~15x)
    assert dot_time(mixed_precision(graph)) < dot_time(graph) / 1.9
    with jax.default_matmul_precision("float32"):
        assert dot_time(mixed_precision(graph)) < dot_time(graph) / 5


def test_other_dtypes_refused(mlp_case):
    with pytest.raises(ValueError, match="bfloat16, float16"):
        mixed_precision(mlp_case[4], jnp.int8)


def testscaled_cast_is_a_power_of_two_into_float16_range():
    for x in ([1e-9, -3e-9, 2e-8], [1e6, 3.0, -2e5], [0.5, 0.25], [0.0, 0.0]):
        x = jnp.asarray(x, F32)
        q, inv = scaled_cast(x)
        assert q.dtype == F16
        mantissa, _ = np.frexp(np.float32(inv))
        assert mantissa == 0.5  # an exact power of two: scaling back is exact
        amax = float(jnp.max(jnp.abs(q)))
        assert amax == 0.0 or 2**14 <= amax < 2**15, (x, amax)
        # the same float16 significands as an unscaled cast wherever that one is normal
        np.testing.assert_allclose(q.astype(F32) * inv, x, rtol=2**-11, atol=0)


def _range_step(w, x):
    """Activations past float16's max (65504) and gradients under its smallest
    subnormal (6e-8): an unscaled float16 cast turns them into inf and 0."""
    return jax.value_and_grad(lambda w: jnp.tanh(x @ w).sum() * 1e-7)(w)


def test_fp16_scales_operands_into_range():
    w = jnp.linspace(-1e-3, 1e-3, 64 * 32, dtype=F32).reshape(64, 32)
    x = jnp.linspace(-2e3, 3e3, 16 * 64, dtype=F32).reshape(16, 64) * 30
    graph = capture(_range_step, (w, x))
    mixed = mixed_precision(graph, jnp.float16)
    for g, n in contractions(mixed):
        assert all(g.values[v].dtype == F16 for v in n.inputs), n.key
        assert [g.values[v].dtype for v in n.outputs] == [F32]
    assert sum(1 for n in mixed.nodes if n.op == "reduce_max" and is_range_scale(n)) == 4
    assert mixed.outputs == graph.outputs  # the unscaled results keep their value ids
    want = jax.jit(_range_step)(w, x)
    got = jax.jit(graph_fn(mixed, upcast_contractions=True))(w, x)
    assert_trees_close(got, want, rtol=5e-3, atol=5e-3 * float(jnp.abs(want[1]).max()))

    def unscaled(w, x):  # the same casts without the scales
        h = lambda a: a.astype(F16)
        f = lambda w: jnp.tanh(lax.dot(h(x), h(w), preferred_element_type=F32)).sum() * 1e-7
        return jax.value_and_grad(f)(w)

    naive = jax.jit(unscaled)(w, x)
    assert not np.allclose(naive[1], want[1], rtol=0.1, atol=0.1 * float(jnp.abs(want[1]).max()))


def test_upcast_operands_matches_the_mixed_dot():
    x = jax.random.normal(jax.random.key(0), (8, 16)).astype(BF16)
    w = jax.random.normal(jax.random.key(1), (16, 4)).astype(BF16)
    mixed = lax.dot_general(x, w, MATMUL, preferred_element_type=F32)
    graph = capture(lambda a, b: a @ b, (x.astype(F32), w.astype(F32)))
    conv = mixed_precision(graph)
    dot = next(n for n in conv.nodes if n.op == "dot_general")
    up = upcast_operands(dot, [x, w])
    assert all(u.dtype == F32 for u in up)
    # the same exact products; float32 sums, perhaps in another order
    np.testing.assert_allclose(up[0] @ up[1], mixed, rtol=1e-6, atol=1e-6)
    got = graph_fn(conv)(x.astype(F32), w.astype(F32))[0]
    np.testing.assert_allclose(got, mixed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("precision", "dtype", "rtol"), [("bf16", BF16, 1e-2), ("fp16", F16, 1e-4)]
)
def test_parallelize_trains_in_low_precision_and_records_it(tmp_path, precision, dtype, rtol):
    """`parallelize(precision=...)`: a sharded GPT step with bf16 or fp16 contractions
    follows the f32 single-device step to that precision, and the plan file replays."""
    import autopar
    from autopar.examples.models import gpt

    cfg = gpt.GPTConfig(hidden=64, heads=4, seq=32, vocab=256, layers=2)
    ts = gpt.make_train_step(cfg)
    state, batch = jax.jit(ts.init)(0), ts.batch(0)
    mesh = {"data": 2, "model": 4}
    step = autopar.parallelize(ts.step, mesh=mesh, cluster="cpu", precision=precision)
    plan = step.plan(state, batch)
    assert plan.precision == dtype.name
    assert any("mixed precision" in w for w in plan.warnings)
    new, metrics = step(state, batch)
    ref, ref_metrics = jax.jit(ts.step)(state, batch)
    assert_trees_close(metrics["loss"], ref_metrics["loss"], rtol=rtol, atol=0, what="loss")
    assert all(x.dtype == F32 for x in jax.tree.leaves(new["params"]))  # master weights
    hlo = step.lower(state, batch).as_text()
    assert _mlir(dtype) in hlo  # the contractions' operands are cast in the program
    path = tmp_path / "plan.json"
    plan.save(path)
    replay = autopar.parallelize(ts.step, mesh=mesh, cluster="cpu", plan=path)
    assert replay.plan(state, batch).precision == dtype.name
    assert_trees_close(replay(state, batch), (new, metrics), rtol=0, atol=0)
    with pytest.raises(autopar.AutoparError, match="'bf16' or 'fp16'"):
        autopar.parallelize(ts.step, mesh=mesh, precision="fp8")


def _mlir(dtype) -> str:
    return {BF16: "bf16", F16: "f16"}[np.dtype(dtype)]


def test_a_plan_on_cpu_devices_says_its_bf16_dots_run_in_float32():
    """On CPU devices the lowered program rounds the operands to bfloat16 and runs the
    dots in float32 (no bf16 kernel accumulating in float32 there): the plan said only
    that they "compute in bfloat16", priced at the GPU's rate; it says both now."""
    import autopar

    def f(w, x):
        return jnp.tanh(x @ w).sum()

    args = (jnp.ones((64, 64)), jnp.ones((32, 64)))
    plan = autopar.parallelize(f, mesh={"data": 8}, precision="bf16").plan(*args)
    assert any("on CPU devices the bfloat16 operands are rounded" in w for w in plan.warnings)
    # planned offline (more devices than here: an abstract mesh, lowered for GPUs)
    offline = autopar.parallelize(f, mesh={"data": 16}, precision="bf16").plan(*args)
    assert not any("on CPU devices" in w for w in offline.warnings)
