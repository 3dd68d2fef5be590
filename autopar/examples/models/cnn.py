"""A small CNN with batch normalization and pooling (``reduce_window`` primitives).

Architecture (NHWC)::

    conv_0 (3x3, width) -> bn_0 -> relu -> max_pool 2x2
    conv_1 (3x3, 2*width) -> bn_1 -> relu -> avg_pool 2x2
    flatten -> head (Dense, classes)

Batch norm runs in training mode (``use_running_average=False``); its running
statistics live in ``state["batch_stats"]`` and are updated by the train step.
"""

from __future__ import annotations

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
    batch_norm_train_step,
    image_batch,
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
    """Position-dependent images and labels (:func:`autopar.examples.models.common.image_batch`)."""
    return image_batch(config, seed)


def make_train_step(config: CNNConfig, learning_rate: float = 1e-2) -> TrainStep:
    """AdamW train step; ``state`` has ``params``, ``batch_stats`` and ``opt_state``."""
    model = CNN(config)
    return batch_norm_train_step("cnn", model, config, learning_rate)


def abstract_args(config: CNNConfig) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` for ``make_train_step(config).step``, without allocation."""
    return abstract_args_of(make_train_step(config))
