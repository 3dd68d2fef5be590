"""Branches (`lax.cond`, `lax.switch`): every branch is searched to one interface (the
cond's operand and result specs), and the lowering runs `lax.switch` over the branches,
each under its own plan. Checked against single-device `jax.jit` on position-dependent
inputs, on every branch, forward, gradients and optimizer steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_trees_close, is_sharded, replay_from_file

import autopar
from autopar.ir.capture import capture
from autopar.passes.precision import describe, graph_fn, mixed_precision
from autopar.tools.hlo import parse_collectives

MESH = {"data": 4, "model": 2}
CLUSTER = "cpu"  # on a GPU profile these small shapes would (rightly) stay replicated
B, D, H = 64, 128, 256


def _params():
    return {
        "w1": jnp.sin(jnp.arange(D * H, dtype=jnp.float32).reshape(D, H)) / D**0.5,
        "w2": jnp.cos(jnp.arange(H * D, dtype=jnp.float32).reshape(H, D)) / H**0.5,
    }


def _batch(i: int):
    x = jnp.sin(jnp.arange(B * D, dtype=jnp.float32).reshape(B, D) * (0.01 + 0.003 * i))
    return x, jnp.cos(x * 3.0)


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def _train_step(opt):
    def step(params, state, x, y):
        loss, g = jax.value_and_grad(_loss)(params, x, y)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


# SGD with momentum, not Adam: Adam divides each gradient element by its own RMS, which
# turns rounding noise in near-zero gradients into lr-sized updates (tests/test_numerics.py)
OPTIMIZERS = {
    # the inner update runs under a cond: every second step, else the gradients add up
    "multisteps": lambda: optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2),
    # the update runs under a cond that skips it when the gradients are not finite
    "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(0.1, momentum=0.9), 2),
}


def _cond_ops(plan):
    return [o for o in plan.ops if o.op == "cond"]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_under_cond_matches_jit(name):
    opt = OPTIMIZERS[name]()
    step = _train_step(opt)
    params = _params()
    state = opt.init(params)
    par = autopar.parallelize(step, mesh=MESH, cluster=CLUSTER)
    plan = par.plan(params, state, *_batch(0))
    assert not any("runs replicated" in w for w in plan.warnings), plan.warnings
    (cond,) = _cond_ops(plan)
    assert len(cond.branches) == 2
    for b in cond.branches:  # every branch reads the operands as the cond has them ...
        assert tuple(r.spec for r in b.inputs) == cond.in_specs[1:]
        assert tuple(r.spec for r in b.outputs) == cond.out_specs  # ... and returns them so
    # the optimizer state is searched like the rest, not replicated around the cond
    assert any(is_sharded(s.to_pspec()) for s in cond.in_specs), str(plan)
    ref = jax.jit(step)
    for i in range(3):  # MultiSteps: accumulate, update, accumulate
        x, y = _batch(i)
        want = ref(params, state, x, y)
        got = par(params, state, x, y)
        assert_trees_close(got, want, what=f"{name} step {i}")
        params, state = want[0], want[1]
    lowered = par.lower(params, state, *_batch(0))
    assert "stablehlo.case" in lowered.as_text()  # XLA may then make it selects, as for jit
    parse_collectives(lowered.compile().as_text(), par.mesh)


def _branchy(w, v, x, k):
    """Three branches that compute different things with different shapes inside; the
    middle one transposes `w`, so its natural result layout differs from the others'."""
    branches = [
        lambda w, v, x: (jnp.tanh(x @ w) @ v, jnp.sum(w, axis=0)),
        lambda w, v, x: ((x @ w @ w.T @ w) @ v * 0.5, jnp.max(w, axis=0)),
        lambda w, v, x: (x @ v.T @ v, jnp.zeros(w.shape[1])),
    ]
    out, stat = jax.lax.switch(k, branches, w, v, x)
    return jnp.mean(out**2) + jnp.sum(stat)


def test_switch_forward_and_gradients_on_every_branch(tmp_path):
    w = _params()["w1"]
    v = _params()["w2"] / 4
    x, _ = _batch(1)
    fn = jax.value_and_grad(_branchy, argnums=(0, 1))
    par = autopar.parallelize(fn, mesh=MESH, cluster=CLUSTER)
    plan = par.plan(w, v, x, 0)
    assert not any("runs replicated" in w for w in plan.warnings), plan.warnings
    conds = _cond_ops(plan)
    assert len(conds) == 2  # the forward switch and its transpose in the backward pass
    assert all(len(c.branches) == 3 for c in conds)
    assert "branch 2" in str(plan)
    ref = jax.jit(fn)
    for k in range(3):
        assert_trees_close(par(w, v, x, k), ref(w, v, x, k), what=f"branch {k}")
    # the plan file holds the branches' plans and replays bit for bit
    again = replay_from_file(par, fn, (w, v, x, 2), tmp_path, mesh=MESH, cluster=CLUSTER)
    assert [len(c.branches) for c in _cond_ops(again)] == [3, 3]


def test_cond_inside_a_scan_and_in_mixed_precision():
    """A cond in a loop body is searched with the body; mixed precision converts the
    contractions inside the branches too."""
    w = _params()["w1"][:, :D]  # square, so the loop carries one shape

    def layers(w, x):
        def body(h, i):
            h = jax.lax.cond(i % 2 == 0, lambda h: jnp.tanh(h @ w), lambda h: h @ w.T, h)
            return h, jnp.sum(h)

        h, sums = jax.lax.scan(body, x, jnp.arange(4))
        return jnp.mean(h**2) + jnp.sum(sums)

    fn = jax.value_and_grad(layers)
    x, _ = _batch(2)
    par = autopar.parallelize(fn, mesh=MESH, cluster=CLUSTER)
    plan = par.plan(w, x)
    assert not any("runs replicated" in m for m in plan.warnings), plan.warnings
    body_conds = [o for s in plan.ops if s.body is not None for o in _cond_ops(s.body)]
    assert body_conds and all(len(c.branches) == 2 for c in body_conds)
    assert_trees_close(par(w, x), jax.jit(fn)(w, x))

    graph = capture(fn, (w, x))
    report = describe(graph)
    assert sum("branch" in c.scope for c in report.conversions) >= 2, report
    mixed = autopar.parallelize(fn, mesh=MESH, cluster=CLUSTER, precision="bfloat16")
    # what the single-device program computes with the same bfloat16 contractions
    want = jax.jit(graph_fn(mixed_precision(graph), upcast_contractions=True))(w, x)
    assert_trees_close(tuple(mixed(w, x)), tuple(want), rtol=1e-4, atol=1e-4)


def test_a_multisteps_cond_costs_what_data_parallelism_pays():
    """`optax.MultiSteps` puts the update under a cond of elementwise branches. Planned
    data parallel, the gradients are summed as plain AdamW's are and the cond runs on
    whole operands with whole results; it was priced 7x plain AdamW's step, the branch
    searched alone splitting the update and every result all-gathered after the cond."""
    f = jnp.float32
    params = {
        "w1": jax.ShapeDtypeStruct((128, 512), f),
        "b1": jax.ShapeDtypeStruct((512,), f),
        "w2": jax.ShapeDtypeStruct((512, 128), f),
        "b2": jax.ShapeDtypeStruct((128,), f),
    }
    x, y = jax.ShapeDtypeStruct((2048, 128), f), jax.ShapeDtypeStruct((2048, 128), f)

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    prices = {}
    for name, opt in {
        "adamw": optax.adamw(1e-3),
        "multisteps": optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2),
    }.items():

        def step(p, s, x, y, opt=opt):
            g = jax.grad(loss)(p, x, y)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        state = jax.eval_shape(opt.init, params)
        plan = autopar.parallelize(step, mesh={"data": 8}).plan(params, state, x, y)
        prices[name] = plan.cost
    assert prices["multisteps"].step_s < 1.5 * prices["adamw"].step_s, prices
    assert not any(k.startswith("all-gather") for k in prices["multisteps"].comm_bytes), prices
