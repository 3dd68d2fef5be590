"""Wide-ResNet with bottleneck blocks, as in Alpa's benchmark suite (NHWC, BatchNorm).

Architecture (Alpa's ``wide_resnet.py``, itself the Flax ResNet example with a width
factor on the 3x3 convolution)::

    conv_init 7x7/2 (filters) -> bn_init -> relu -> max_pool 3x3/2
    stage k (k = 0..3), ``stage_sizes[k]`` bottleneck blocks of ``f = filters * 2**k``:
        conv 1x1 (f) -> bn -> relu -> conv 3x3 (f * width, stride 2 on a stage's first
        block for k > 0) -> bn -> relu -> conv 1x1 (4 f) -> bn
        (+ conv_proj 1x1 / norm_proj on the residual when the shape changes) -> relu
    global average pool -> head (Dense, classes)

50 layers is ``stage_sizes=(3, 4, 6, 3)``. Batch norm runs in training mode and its
running statistics live in ``state["batch_stats"]``. Unlike Alpa, the last BatchNorm of a
block starts with scale 1 (not 0), so every parameter gets a gradient from step one.
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
    batch_norm_train_step,
    image_batch,
)

STAGES_50 = (3, 4, 6, 3)


@dataclass(frozen=True)
class WideResNetConfig:
    """Wide-ResNet hyper-parameters; ``filters`` is Alpa's ``num_channels`` (the base)."""

    image: int = 32
    channels: int = 3
    filters: int = 8
    width: int = 2
    stage_sizes: tuple[int, ...] = (1, 1)
    classes: int = 10
    batch_size: int = 8
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        # conv_init /2, max_pool /2, then /2 per stage after the first.
        if self.image % (4 * 2 ** max(len(self.stage_sizes) - 1, 0)):
            raise ValueError(
                f"image={self.image} must be divisible by {4 * 2 ** (len(self.stage_sizes) - 1)}"
            )

    @property
    def depth(self) -> int:
        """Layers in the ResNet sense: 3 per bottleneck block + stem + head."""
        return 3 * sum(self.stage_sizes) + 2


class BottleneckBlock(nn.Module):
    filters: int
    width: int
    strides: tuple[int, int]
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        common = {"dtype": self.dtype, "param_dtype": self.dtype}
        conv = functools.partial(nn.Conv, use_bias=False, **common)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, **common)
        y = conv(self.filters, (1, 1), name="conv_0")(x)
        y = nn.relu(norm(name="bn_0")(y))
        y = conv(self.filters * self.width, (3, 3), self.strides, padding="SAME", name="conv_1")(y)
        y = nn.relu(norm(name="bn_1")(y))
        y = conv(self.filters * 4, (1, 1), name="conv_2")(y)
        y = norm(name="bn_2")(y)
        residual = x
        if residual.shape != y.shape:
            residual = conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(x)
            residual = norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class WideResNet(nn.Module):
    """``images [B, H, W, C] -> logits [B, classes]``."""

    config: WideResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        common = {"dtype": cfg.dtype, "param_dtype": cfg.dtype}
        x = nn.Conv(
            cfg.filters,
            (7, 7),
            (2, 2),
            padding=[(3, 3), (3, 3)],
            use_bias=False,
            name="conv_init",
            **common,
        )(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, name="bn_init", **common)(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(cfg.stage_sizes):
            for j in range(blocks):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = BottleneckBlock(
                    cfg.filters * 2**i, cfg.width, strides, cfg.dtype, name=f"stage{i}_block{j}"
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.classes, name="head", **common)(x)


def make_batch(config: WideResNetConfig, seed: int) -> Batch:
    """Position-dependent images and labels (:func:`autopar.examples.models.common.image_batch`)."""
    return image_batch(config, seed)


def make_train_step(config: WideResNetConfig, learning_rate: float = 1e-2) -> TrainStep:
    """AdamW train step; ``state`` has ``params``, ``batch_stats`` and ``opt_state``."""
    model = WideResNet(config)
    return batch_norm_train_step("wide_resnet", model, config, learning_rate)


def abstract_args(config: WideResNetConfig) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` for ``make_train_step(config).step``, without allocation."""
    return abstract_args_of(make_train_step(config))
