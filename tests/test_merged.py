"""A mesh the user gives also gets its plans with the axes merged (`compile.merged`): a
plan of the 1-D mesh of the same devices is a plan of the 2-D one, and the engines on
the 2-D mesh's large tables can miss it."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from helpers import assert_trees_close

import autopar
from autopar.examples.models import gpt


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


def test_a_mesh_shape_search_offers_each_shape_its_merged_axes_plan(monkeypatch):
    """`mesh=N` searches shapes of two and three axes too; each gets the merged mesh's
    plan as a candidate, as a mesh the user gives does (a trial's 8B step: `mesh=64`
    returned 1952 ms where its `{"data": 8, "model": 8}` shape, given alone, gives 1385
    with it), from one search of the merged 1-D mesh for all of them."""
    from autopar.compile import driver, merged

    seeded, searched = [], []
    real_seeds, real_dp = driver.merged_seeds, merged.ENGINES["dp"]

    def seeds(graph, problem):
        got = real_seeds(graph, problem)
        seeded.append((problem.mesh.axis_sizes, sorted(got)))
        return got

    def dp(problem, *rest):
        searched.append(problem.mesh.axis_names)
        return real_dp(problem, *rest)

    monkeypatch.setattr(driver, "merged_seeds", seeds)
    monkeypatch.setitem(merged.ENGINES, "dp", dp)
    monkeypatch.setenv("AUTOPAR_WORKERS", "1")  # the searches in this process, to count
    cfg = gpt.GPTConfig(
        hidden=1024, heads=8, seq=256, vocab=1024, layers=2, batch_size=16, scan_layers=False
    )
    ts = gpt.make_train_step(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not compile-checked: no devices for 32
        autopar.parallelize(ts.step, mesh=32, cluster="h100-sxm", progress=False).plan(
            *gpt.abstract_args(cfg)
        )
    multi = [names for sizes, names in seeded if sum(n > 1 for n in sizes) >= 2]
    assert multi and all(any(n.startswith("dp@") for n in names) for names in multi), seeded
    assert len([m for m in searched if len(m) == 1 and "*" in m[0]]) == 1, searched
