"""Tests for the example models in ``autopar.examples.models``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from autopar.examples.models import cnn, embedding, gpt, mlp
from autopar.examples.models.common import TrainStep, abstract

MODELS = [
    pytest.param(gpt, gpt.GPTConfig(), id="gpt"),
    pytest.param(cnn, cnn.CNNConfig(), id="cnn"),
    pytest.param(mlp, mlp.MLPConfig(), id="mlp"),
    pytest.param(embedding, embedding.EmbeddingConfig(), id="embedding"),
]


def _primitives(jaxpr: jcore.Jaxpr, acc: set[str] | None = None) -> set[str]:
    """Primitive names in ``jaxpr``, including nested jaxprs (jit, custom_jvp_call, ...)."""
    acc = set() if acc is None else acc
    for eqn in jaxpr.eqns:
        acc.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    _primitives(sub.jaxpr, acc)
                elif isinstance(sub, jcore.Jaxpr):
                    _primitives(sub, acc)
    return acc


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize(("module", "config"), MODELS)
def test_train_steps_reduce_loss(module, config):
    ts = module.make_train_step(config, learning_rate=1e-2)
    assert isinstance(ts, TrainStep)
    state = jax.jit(ts.init)(0)
    batch = jax.jit(ts.batch)(0)
    for x, y in zip(jax.tree.leaves(batch), jax.tree.leaves(ts.batch(0))):
        np.testing.assert_array_equal(x, y)

    # The batch is position-dependent, never constant.
    for leaf in jax.tree.leaves(batch):
        assert np.unique(np.asarray(leaf)).size > 1

    # abstract_args agrees with the real arrays.
    state_sds, batch_sds = module.abstract_args(config)
    assert _shapes(state_sds) == _shapes(state)
    assert _shapes(batch_sds) == _shapes(batch)
    assert _shapes(abstract(state)) == _shapes(state)

    step = jax.jit(ts.step)
    first_state = state
    initial = float(jax.jit(ts.loss)(state, batch))
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite([initial, *losses]))
    assert losses[0] == pytest.approx(initial, rel=1e-4)
    assert losses[-1] < losses[0]
    assert _shapes(state) == _shapes(state_sds)
    if "batch_stats" in state:  # CNN: running statistics are updated by the step.
        before = jax.tree.leaves(first_state["batch_stats"])
        after = jax.tree.leaves(state["batch_stats"])
        assert any(not np.allclose(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize(("module", "config"), MODELS)
def test_batch_depends_on_seed(module, config):
    ts = module.make_train_step(config)
    a, b = ts.batch(0), ts.batch(1)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(ts.batch(0))):
        np.testing.assert_array_equal(x, y)


def test_gpt_param_paths():
    state_sds, _ = gpt.abstract_args(gpt.GPTConfig(layers=2))
    params = state_sds["params"]
    assert set(params) == {"wte", "wpe", "h_0", "h_1", "ln_f"}
    assert set(params["h_0"]) == {"ln_1", "attn", "ln_2", "mlp"}
    assert set(params["h_0"]["attn"]) == {"q", "k", "v", "o"}
    assert set(params["h_0"]["mlp"]) == {"c_fc", "c_proj"}
    assert params["h_0"]["mlp"]["c_fc"]["kernel"].shape == (64, 256)


def test_cnn_uses_reduce_window():
    config = cnn.CNNConfig()
    ts = cnn.make_train_step(config)
    prims = _primitives(jax.make_jaxpr(ts.step)(*cnn.abstract_args(config)).jaxpr)
    assert {"reduce_window_max", "reduce_window_sum", "conv_general_dilated"} <= prims
    assert "select_and_scatter_add" in prims  # gradient of max_pool


def test_gpt_6_7b_traces_without_allocation():
    config = gpt.GPTConfig(layers=32, hidden=4096, heads=32, seq=1024, vocab=51200, batch_size=16)
    state_sds, batch_sds = gpt.abstract_args(config)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state_sds))
    n_params = sum(x.size for x in jax.tree.leaves(state_sds["params"]))
    assert 6.5e9 < n_params < 6.8e9
    assert batch_sds["inputs"].shape == (16, 1024)
    jaxpr = jax.make_jaxpr(gpt.make_train_step(config).step)(state_sds, batch_sds)
    assert "dot_general" in _primitives(jaxpr.jaxpr)


def test_mlp_block_matches_manual_gradient():
    config = gpt.MLPBlockConfig(batch=2, seq=4, hidden=8, ffn=16)
    params = gpt.mlp_block_init(config, 0)
    x = gpt.mlp_block_input(config, 0)
    params_sds, x_sds = gpt.mlp_block_abstract_args(config)
    assert _shapes(params_sds) == _shapes(params)
    assert x_sds.shape == x.shape == (2, 4, 8)

    loss, grads = jax.jit(gpt.mlp_block_value_and_grad)(params, x)
    h = jax.nn.gelu(x @ params["w1"])
    np.testing.assert_allclose(loss, jnp.sum(h @ params["w2"]), rtol=1e-5)
    # d/dW2 sum(h @ W2) = h^T @ ones.
    expected_w2 = jnp.einsum("bsf,bsh->fh", h, jnp.ones_like(x))
    np.testing.assert_allclose(grads["w2"], expected_w2, rtol=1e-5, atol=1e-5)
    assert grads["w1"].shape == params["w1"].shape


def test_demo_plans_trains_and_matches_jit(capsys, monkeypatch):
    """`autopar demo` end to end (plan, two sharded training steps, the comparison with
    single-device jax.jit, the verdict) on the demo's own code, with its GPT shrunk to a
    2-layer, 64-wide one so it runs in the default tier: it plans a sharded layout,
    returns sharded state (parameters or optimizer state), and its losses match jax.jit's."""
    import re

    from autopar.examples import demo

    monkeypatch.setattr(
        demo, "MODEL", dict(vocab=256, seq=32, hidden=64, layers=2, heads=4, batch_size=8)
    )
    assert demo.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "hidden 64, heads 4, layers 2" in out
    assert re.search(r"parameter input shardings: \d+ of 36 sharded", out), out
    losses = re.findall(r"^\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+\S+$", out, re.M)
    assert [i for i, _, _ in losses] == ["0", "1"], out
    for _, ours, ref in losses:
        assert float(ours) == pytest.approx(float(ref), rel=1e-5)
    # the plan shards some of the state it returns (at this size: the optimizer moments,
    # as ZeRO-1 does; the parameters stay whole)
    sharded = re.findall(
        r"returned (?:params|opt_state) live on 8 devices: (\d+) of \d+ arrays", out
    )
    assert len(sharded) == 2 and sum(map(int, sharded)) > 0, out
    assert "MATCH: autopar losses match single-device jax.jit" in out
