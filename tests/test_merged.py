"""A mesh the user gives also gets its plans with the axes merged (`compile.merged`): a
plan of the 1-D mesh of the same devices is a plan of the 2-D one, and the engines on
the 2-D mesh's large tables can miss it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from helpers import assert_trees_close

import autopar


class _MLP(nn.Module):
    """Pre-norm residual MLP blocks as linen writes them (Dense with bias)."""

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = x + nn.Dense(256)(nn.gelu(nn.Dense(1024)(nn.LayerNorm()(x))))
        return nn.Dense(10)(x.mean(1))


def _step_and_state():
    model, tx = _MLP(), optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    x = jnp.sin(jnp.arange(2 * 64 * 256, dtype=jnp.float32)).reshape(2, 64, 256)
    y = jnp.array([3, 7], jnp.int32)
    params = model.init(jax.random.key(0), x)
    return step, (params, tx.init(params), x, y)


def test_a_2d_mesh_finds_the_plan_of_its_merged_axes():
    """At batch 2, the 8-device 1-D mesh's plan (mostly whole, little to all-reduce) is
    cheaper than what the engines find on `{"data": 2, "model": 4}` alone (0.0634 against
    0.0508 ms before the merged mesh's plan was a candidate); with it the 2-D plan is
    priced as the 1-D one, names it, and trains equal to `jax.jit`."""
    step, args = _step_and_state()
    flat = autopar.parallelize(step, mesh={"data": 8}).plan(*args)
    two_d = autopar.parallelize(step, mesh={"data": 2, "model": 4})
    plan = two_d.plan(*args)
    assert plan.cost.step_s <= flat.cost.step_s * (1 + 1e-9), (plan.cost, flat.cost)
    assert "dp@data*model" in plan.candidates, plan.candidates
    state, ref = args, args
    for _ in range(2):
        state = (*two_d(*state)[:2], *args[2:])
        ref = (*jax.jit(step)(*ref)[:2], *args[2:])
    # Adam divides by the gradient's own scale: a reduction order's rounding in a tiny
    # gradient moves a weight by ~1e-5 after two steps (a hand-sharded `jax.jit` too)
    assert_trees_close(state[:2], ref[:2], rtol=1e-4, atol=1e-4)
