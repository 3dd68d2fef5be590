"""A small CNN with batch normalization and pooling (``reduce_window`` primitives).

Architecture (NHWC)::

    conv_0 (3x3, width) -> bn_0 -> relu -> max_pool 2x2
    conv_1 (3x3, 2*width) -> bn_1 -> relu -> avg_pool 2x2
    flatten -> head (Dense, classes)

Batch norm runs in training mode (``use_running_average=False``); its running
statistics live in ``state["batch_stats"]`` and are updated by the train step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.models.common import (
    Batch,
    PyTree,
    State,
    TrainStep,
    abstract_args_of,
    make_optimizer,
)


@dataclass(frozen=True)
class CNNConfig:
    """CNN hyper-parameters; images are ``[batch_size, image, image, channels]``."""

    image: int = 16
    channels: int = 3
    width: int = 8
    classes: int = 10
    batch_size: int = 8
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        if self.image % 4:
            raise ValueError(f"image={self.image} must be divisible by 4 (two 2x2 pools)")


class CNN(nn.Module):
    """``images [B, H, W, C] -> logits [B, classes]``."""

    config: CNNConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        common = {"dtype": cfg.dtype, "param_dtype": cfg.dtype}
        x = nn.Conv(cfg.width, (3, 3), padding="SAME", name="conv_0", **common)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn_0", **common)(x)
        x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = nn.Conv(2 * cfg.width, (3, 3), padding="SAME", name="conv_1", **common)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn_1", **common)(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(cfg.classes, name="head", **common)(x)


def make_batch(config: CNNConfig, seed: int) -> Batch:
    """``{"images": [B, H, W, C] float in [-0.75, 0.75], "labels": [B] int32}``."""
    shape = (config.batch_size, config.image, config.image, config.channels)
    n = config.batch_size * config.image * config.image * config.channels
    v = (jnp.arange(n, dtype=jnp.int32) * 13 + seed * 5) % 97
    # Power-of-two scale keeps the values exact (identical under jit and eagerly).
    images = (v.astype(jnp.float32) / 64.0 - 0.75).reshape(shape)
    labels = (jnp.arange(config.batch_size, dtype=jnp.int32) * 3 + seed) % config.classes
    return {"images": images.astype(config.dtype), "labels": labels}


def make_train_step(config: CNNConfig, learning_rate: float = 1e-2) -> TrainStep:
    """AdamW train step for :class:`CNN`; ``state`` has ``params``, ``batch_stats``, ``opt_state``."""
    model = CNN(config)
    tx = make_optimizer(learning_rate)

    def forward(params: PyTree, batch_stats: PyTree, batch: Batch) -> tuple[jax.Array, PyTree]:
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats},
            batch["images"],
            mutable=["batch_stats"],
        )
        logits = logits.astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss, updates["batch_stats"]

    def init(seed: int) -> State:
        dummy = jnp.zeros(
            (config.batch_size, config.image, config.image, config.channels), config.dtype
        )
        variables = model.init(jax.random.key(seed), dummy)
        params = variables["params"]
        return {
            "params": params,
            "batch_stats": variables["batch_stats"],
            "opt_state": tx.init(params),
        }

    def loss(state: State, batch: Batch) -> jax.Array:
        return forward(state["params"], state["batch_stats"], batch)[0]

    def step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        params = state["params"]
        (value, batch_stats), grads = jax.value_and_grad(forward, has_aux=True)(
            params, state["batch_stats"], batch
        )
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, updates)
        new_state = {"params": params, "batch_stats": batch_stats, "opt_state": opt_state}
        return new_state, {"loss": value}

    return TrainStep(
        step=step,
        init=init,
        batch=functools.partial(make_batch, config),
        loss=loss,
        name="cnn",
    )


def abstract_args(config: CNNConfig) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` for ``make_train_step(config).step``, without allocation."""
    return abstract_args_of(make_train_step(config))
