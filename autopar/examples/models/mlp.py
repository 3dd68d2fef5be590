"""A plain multi-layer perceptron regressor with mean-squared-error loss.

Parameter paths: ``dense_0``, ..., ``dense_{layers-1}`` (hidden, ReLU) and ``out``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from autopar.examples.models.common import (
    Batch,
    PyTree,
    TrainStep,
    abstract_args_of,
    simple_train_step,
)


@dataclass(frozen=True)
class MLPConfig:
    """MLP hyper-parameters: ``x [batch_size, din] -> y [batch_size, dout]``."""

    batch_size: int = 16
    din: int = 32
    hidden: int = 64
    dout: int = 8
    layers: int = 2
    dtype: Any = jnp.float32


class MLP(nn.Module):
    """``layers`` hidden Dense+ReLU layers followed by a linear output layer."""

    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        common = {"dtype": cfg.dtype, "param_dtype": cfg.dtype}
        for i in range(cfg.layers):
            x = nn.relu(nn.Dense(cfg.hidden, name=f"dense_{i}", **common)(x))
        return nn.Dense(cfg.dout, name="out", **common)(x)


def make_batch(config: MLPConfig, seed: int) -> Batch:
    """``{"x": [B, din], "y": [B, dout]}``, both float in ~[-0.7, 0.7], position-dependent.

    Power-of-two scaling keeps the values exact (identical under jit and eagerly).
    """
    b = config.batch_size
    vx = (jnp.arange(b * config.din, dtype=jnp.int32) * 17 + seed * 3) % 89
    vy = (jnp.arange(b * config.dout, dtype=jnp.int32) * 29 + seed * 7) % 83
    x = (vx.astype(jnp.float32) / 64.0 - 0.6875).reshape(b, config.din)
    y = (vy.astype(jnp.float32) / 64.0 - 0.640625).reshape(b, config.dout)
    return {"x": x.astype(config.dtype), "y": y.astype(config.dtype)}


def make_train_step(config: MLPConfig, learning_rate: float = 1e-2) -> TrainStep:
    """AdamW train step for :class:`MLP` with mean-squared-error loss."""
    model = MLP(config)

    def init_params(seed: int) -> PyTree:
        dummy = jnp.zeros((config.batch_size, config.din), config.dtype)
        return model.init(jax.random.key(seed), dummy)["params"]

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        pred = model.apply({"params": params}, batch["x"]).astype(jnp.float32)
        return jnp.mean(jnp.square(pred - batch["y"].astype(jnp.float32)))

    return simple_train_step(
        "mlp", loss_fn, init_params, functools.partial(make_batch, config), learning_rate
    )


def abstract_args(config: MLPConfig) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` for ``make_train_step(config).step``, without allocation."""
    return abstract_args_of(make_train_step(config))
