"""Partial sums passed through linear ops (autopar/strategies/linear.py) and their
stacked lowering (autopar/lower/jit.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close

import autopar
import cost_models
from autopar.cost.model import CostModel
from autopar.examples.models import gpt
from autopar.ir.graph import TensorType
from autopar.meshes import make_mesh
from autopar.sharding import Spec, mesh_info
from autopar.tools.hlo import parse_collectives

MEGATRON = {"w1": jax.P(None, "model"), "w2": jax.P("model", None)}


def _only_collectives(step, *args) -> list[tuple[str, int]]:
    colls = parse_collectives(step.lower(*args).compile().as_text(), step.mesh)
    return [(c.kind, c.bytes) for c in colls]


def test_megatron_mlp_sums_only_the_loss():
    """sum(gelu(x @ W1) @ W2), shapes where compute matters (abstract args): dp finds the
    column/row split, and the partial product flows through convert and reduce_sum, so
    the only collective is the scalar loss's all-reduce (Megatron's hand-written plan
    all-reduces the whole activation)."""
    cfg = gpt.MLPBlockConfig(batch=8, seq=256, hidden=1024, ffn=4096, dtype=jnp.bfloat16)
    args = gpt.mlp_block_abstract_args(cfg)
    step = autopar.parallelize(gpt.mlp_block_value_and_grad, mesh={"model": 8}, engine="dp")
    plan = step.plan(*args)
    assert plan.in_specs[0] == MEGATRON
    assert plan.cost.comm_bytes == {"all-reduce@model": 4}
    assert _only_collectives(step, *args) == [("all-reduce", 4)]


def test_passed_through_sum_is_exact():
    """The same program on real (small) arrays with the Megatron split pinned."""
    cfg = gpt.MLPBlockConfig(batch=8, seq=64, hidden=64, ffn=256, dtype=jnp.float32)
    params, x = gpt.mlp_block_init(cfg), gpt.mlp_block_input(cfg)
    f = gpt.mlp_block_value_and_grad
    step = autopar.parallelize(f, mesh={"model": 8}, engine="dp", in_specs=(MEGATRON, None))
    assert _only_collectives(step, params, x) == [("all-reduce", 4)]
    assert_trees_close(step(params, x), jax.jit(f)(params, x), rtol=1e-5, atol=1e-5)


def test_partial_destination_costs_the_sum_then_splits_free():
    profile = cost_models.load("h100-sxm")
    info = mesh_info(make_mesh({"data": 2, "model": 4}), profile.devices_per_node)
    cm = CostModel(profile, info)
    t = TensorType((64, 64), np.dtype(np.float32))
    p_model = Spec(((), ()), ("model",))
    p_data = Spec(((), ()), ("data",))
    assert cm.reshard(t, Spec.replicated(2), p_model).seconds == 0
    assert cm.reshard(t, p_model, p_model).seconds == 0
    moved = cm.reshard(t, p_model, p_data)
    assert [c.kind for c in moved.collectives] == ["all-reduce"]
    assert moved.seconds == cm.reshard(t, p_model, Spec.replicated(2)).seconds


def test_partial_sum_read_split_and_whole_is_summed_once():
    """A weight gradient (partial over `data`) that one use reads split (a global norm's
    square, here pinned by a constraint) and another whole (returned): the lowering
    sums it once, into the whole layout every other use slices for free
    (`settle_spec`), and the plan's price counts that one all-reduce. Summed into the
    split layout first, it cost a reduce-scatter and an all-gather; priced once per
    layout, a reduce-scatter and an all-reduce that the program does not have (ViT's
    clipped gradients: 23 phantom reduce-scatters, 0.24 ms of a 0.81 ms prediction)."""
    from collections import Counter

    from jax.sharding import NamedSharding

    from autopar.strategies.settle import settle_spec

    split, whole = Spec((("data",), ())), Spec.replicated(2)
    made = Spec(((), ()), ("data",))
    assert settle_spec(made, Counter({split: 1, whole: 1})) == whole
    assert settle_spec(made, Counter({split: 2})) == split
    assert settle_spec(made, Counter({made: 1, whole: 1})) == made

    mesh = make_mesh({"data": 4})
    d = 512

    def step(w, x):
        g = x.T @ jnp.tanh(x @ w)  # partial over data: x is split by rows
        n = jnp.sum(jax.lax.with_sharding_constraint(g, NamedSharding(mesh, jax.P("data"))) ** 2)
        return g, n

    w = jnp.linspace(-1, 1, d * d, dtype=jnp.float32).reshape(d, d) / 16
    x = jnp.linspace(-1, 1, 64 * d, dtype=jnp.float32).reshape(64, d)
    par = autopar.parallelize(step, mesh={"data": 4}, engine="data", progress=False)
    plan = par.plan(w, x)
    compiled: Counter[str] = Counter()
    for c in parse_collectives(par.lower(w, x).compile().as_text(), par.mesh):
        compiled[f"{c.kind}@{','.join(c.axes)}"] += c.bytes
    assert "reduce-scatter@data" not in plan.cost.comm_bytes, plan.cost.comm_bytes
    assert plan.cost.comm_bytes == dict(compiled)
    assert_trees_close(par(w, x), jax.jit(step)(w, x), rtol=2e-4, atol=1e-4)


def test_partial_operand_specs_survive_the_plan_file(tmp_path):
    cfg = gpt.MLPBlockConfig(batch=8, seq=256, hidden=1024, ffn=4096, dtype=jnp.bfloat16)
    args = gpt.mlp_block_abstract_args(cfg)
    plan = autopar.parallelize(gpt.mlp_block_value_and_grad, mesh={"model": 8}).plan(*args)
    assert any(s.partial for o in plan.ops for s in o.in_specs)  # a passed-through sum
    plan.save(tmp_path / "p.json")
    loaded = autopar.Plan.load(tmp_path / "p.json")
    assert [o.in_specs for o in loaded.ops] == [o.in_specs for o in plan.ops]


@pytest.mark.parametrize(
    "seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_random_plans_of_a_gpt_train_step_are_exact(seed):
    """Random strategies (half of the linear ops passing partial sums) for every op of a
    real train step: layer norm's and softmax's implicitly broadcast operands included."""
    from test_fuzz import random_plan

    cfg = gpt.GPTConfig(hidden=32, heads=4, seq=16, vocab=64, layers=1, batch_size=8)
    ts = gpt.make_train_step(cfg)
    state, batch = jax.jit(ts.init)(0), ts.batch(0)
    want = jax.jit(ts.step)(state, batch)
    jitted, _ = random_plan(ts.step, (state, batch), {"data": 2, "model": 4}, seed)
    got = jitted(*jax.tree.leaves((state, batch)))
    got = jax.tree.unflatten(jax.tree.structure(want), got)
    assert_trees_close(got[1], want[1], rtol=1e-4, atol=1e-5)  # the loss
    assert_trees_close(got[0]["opt_state"], want[0]["opt_state"], rtol=1e-3, atol=1e-5)


def test_batch_norm_statistics_are_summed_where_made_so_xla_combines_them():
    """Conv + BatchNorm, data parallel: a batch norm's two statistics (forward, and
    their backward) are summed where they are made, where XLA combines them into one
    all-reduce, as plain data parallelism compiles them; carried on through the ops
    after them, one depends on the other and each pays its own latency (the `data`
    plan compiled 10 all-reduces here where `jax.jit` has 7). The polish moves each
    group of carrying ops at once (`search.polish.carried_sums`)."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for c in (32, 64, 64):
                x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(c, (3, 3))(x)))
            return nn.Dense(10)(x.mean((1, 2)))

    model = Net()

    def step(params, stats, images, labels):
        def loss_fn(p):
            logits, upd = model.apply(
                {"params": p, "batch_stats": stats}, images, mutable=["batch_stats"]
            )
            onehot = jax.nn.one_hot(labels, 10)
            return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), -1)), upd

        (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        new = jax.tree.map(lambda a, b: a - 0.1 * b, params, g)
        return new, upd["batch_stats"], loss

    images = jnp.linspace(-1.0, 1.0, 16 * 16 * 16 * 3).reshape(16, 16, 16, 3)
    labels = jnp.arange(16) % 10
    v = model.init(jax.random.key(0), images)
    args = (v["params"], v["batch_stats"], images, labels)
    step_ap = autopar.parallelize(step, mesh={"data": 4}, engine="data")
    plan = step_ap.plan(*args)
    assert plan.in_specs[2] == jax.P("data", None, None, None)
    ours = [c for c, _ in _only_collectives(step_ap, *args) if c == "all-reduce"]
    mesh = make_mesh({"data": 4})
    rep, bat = (jax.NamedSharding(mesh, jax.P(*s)) for s in ((), ("data",)))
    hand = jax.jit(step, in_shardings=(rep, rep, bat, bat))
    theirs = parse_collectives(hand.lower(*args).compile().as_text())
    assert len(ours) <= len([c for c in theirs if c.kind == "all-reduce"])
    assert_trees_close(step_ap(*args), jax.jit(step)(*args))


def test_a_sum_reduce_scattered_then_moved_compiles_as_priced():
    """A partial sum read in another layout (`S[data]RRR+P[model]` read as
    `RS[data]S[model]R`, an expert einsum's output in MoE models) is reduce-scattered
    onto the dim `model` goes to, then `data` moved by one all-to-all, as the cost
    model prices it (`Spec.summed_into`). Told only the final layout, XLA summed and
    then moved through an extra all-to-all over `model` (on MoE-10B's 4 x 4 mesh a
    collective-permute of every block across the mesh, 4 ms of unpriced
    communication)."""
    from jax.sharding import NamedSharding

    mesh = make_mesh({"data": 4, "model": 2})

    def step(a, b):
        y = jnp.einsum("ijkm,mn->ijkn", a, b)
        y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, jax.P(None, "data", "model")))
        return jnp.tanh(y)

    a = jnp.linspace(-1, 1, 8 * 8 * 16 * 256, dtype=jnp.float32).reshape(8, 8, 16, 256)
    b = jnp.linspace(-1, 1, 256 * 32, dtype=jnp.float32).reshape(256, 32)
    specs = (jax.P("data", None, None, "model"), jax.P("model", None))
    par = autopar.parallelize(
        step, mesh={"data": 4, "model": 2}, engine="dp", in_specs=specs, progress=False
    )
    plan = par.plan(a, b)
    assert plan.cost.comm_bytes == {"reduce-scatter@model": 32768, "all-to-all@data": 16384}
    compiled = parse_collectives(par.lower(a, b).compile().as_text(), par.mesh)
    # XLA:CPU reduce-scatters as an all-reduce and a slice
    assert [(c.kind, c.axes) for c in compiled] == [
        ("all-reduce", ("model",)),
        ("all-to-all", ("data",)),
    ]
    assert_trees_close(par(a, b), jax.jit(step)(a, b), rtol=2e-4, atol=1e-4)
