"""The benchmark-suite models (GShard MoE, ViT, Wide-ResNet) on tiny configurations.

Each trains two AdamW steps under ``jax.jit``, and ``autopar.parallelize`` on a
``{"data": 2, "model": 4}`` mesh reproduces ``jax.jit``'s loss at every step (rtol 1e-5),
both from the single-device state before each step and free-running on its own state.
The plans are made for the simulated devices (``cluster="cpu"``), where these models
are big enough to shard (on h100-sxm they are planned fully replicated, which would
test nothing): the test checks that some inputs are split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.examples.models import moe, vit
from autopar.examples.models import wide_resnet as wrn

STEPS = 2
MESH = {"data": 2, "model": 4}

TINY = [
    pytest.param(
        moe,
        moe.MoEConfig(
            vocab=64,
            seq=16,
            hidden=32,
            layers=1,
            heads=4,
            experts=4,
            group_size=16,
            moe_every=1,
            batch_size=8,
        ),
        id="moe",
    ),
    pytest.param(
        vit, vit.ViTConfig(image=8, patch=4, hidden=128, layers=1, heads=4, batch_size=8), id="vit"
    ),
    pytest.param(
        wrn,
        wrn.WideResNetConfig(image=16, filters=16, width=2, stage_sizes=(1,), batch_size=8),
        id="wide_resnet",
    ),
]


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize(("module", "config"), TINY)
def test_trains_under_jit_and_autopar_matches(module, config):
    ts = module.make_train_step(config)
    state = jax.jit(ts.init)(0)
    state_sds, batch_sds = module.abstract_args(config)
    assert _shapes(state_sds) == _shapes(state)
    assert _shapes(batch_sds) == _shapes(ts.batch(0))
    for leaf in jax.tree.leaves(ts.batch(0)):  # position-dependent, never constant
        assert np.unique(np.asarray(leaf)).size > 1

    batch = ts.batch(0)  # the same batch every step, so the loss must go down
    step = jax.jit(ts.step)
    states, losses = [state], []
    for _ in range(STEPS):
        new, metrics = step(states[-1], batch)
        states.append(new)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    assert _shapes(states[-1]) == _shapes(state_sds)

    sharded = autopar.parallelize(ts.step, mesh=MESH, cluster="cpu")
    plan = sharded.plan(state_sds, batch_sds)
    assert not plan.warnings, plan.warnings  # every primitive has a sharding rule
    split = [r.path for r in plan.inputs if r.spec.used_axes]
    assert split, f"nothing sharded: {len(plan.inputs)} inputs replicated"
    # From the single-device state before each step.
    for i in range(STEPS):
        _, metrics = sharded(states[i], batch)
        np.testing.assert_allclose(float(metrics["loss"]), losses[i], rtol=1e-5)
    # Free-running on the sharded state: AdamW turns the first step's reduction-order
    # noise into parameter differences of its step size, so the second loss compares
    # a little looser (WRN: 1.1e-5 apart); a wrong layout is off by far more.
    s = state
    for i in range(STEPS):
        s, metrics = sharded(s, batch)
        np.testing.assert_allclose(float(metrics["loss"]), losses[i], rtol=5e-5)
