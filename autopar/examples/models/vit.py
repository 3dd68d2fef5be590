"""Vision Transformer (Dosovitskiy et al. 2021): patches -> pre-LN encoder -> cls head.

Patch embedding is a reshape into ``[B, N, patch*patch*channels]`` followed by a dense
layer (the same linear map as a stride-``patch`` convolution). A learned ``cls`` token is
prepended, learned position embeddings are added, and the classifier reads the final
``cls`` token after a last LayerNorm.

Parameter paths (block ``i``)::

    params/patch_embed/{kernel,bias}     [patch*patch*channels, hidden]
    params/cls                           [1, 1, hidden]
    params/pos_embed                     [1, patches+1, hidden]
    params/h_i/ln_1/{scale,bias}
    params/h_i/attn/{q,k,v,o}/{kernel,bias}
    params/h_i/ln_2/{scale,bias}
    params/h_i/mlp/{c_fc,c_proj}/{kernel,bias}
    params/ln_f/{scale,bias}
    params/head/{kernel,bias}            [hidden, classes]

The attention and MLP names match ``autopar.examples.models.gpt`` so the same path rules (e.g. a
Megatron column/row split) apply to both.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.examples.models import gpt
from autopar.examples.models.common import (
    Batch,
    PyTree,
    TrainStep,
    abstract_args_of,
    simple_train_step,
)

_INIT_STD = 0.02


@dataclass(frozen=True)
class ViTConfig:
    """ViT hyper-parameters; images are ``[batch_size, image, image, channels]``."""

    image: int = 16
    patch: int = 4
    channels: int = 3
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    mlp: int | None = None
    classes: int = 10
    dtype: Any = jnp.float32
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.image % self.patch:
            raise ValueError(f"image={self.image} not divisible by patch={self.patch}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} not divisible by heads={self.heads}")

    @property
    def ffn_dim(self) -> int:
        """The MLP width under the name the shared transformer block reads."""
        return self.mlp_dim

    @property
    def mlp_dim(self) -> int:
        return self.mlp if self.mlp is not None else 4 * self.hidden

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _dense(features: int, name: str, dtype: Any) -> nn.Dense:
    return nn.Dense(
        features,
        name=name,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nn.initializers.normal(_INIT_STD),
    )


def patchify(images: jax.Array, patch: int) -> jax.Array:
    """``[B, H, W, C] -> [B, (H/p)(W/p), p*p*C]`` (row-major patches)."""
    b, h, w, c = images.shape
    x = images.reshape(b, h // patch, patch, w // patch, patch, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


class ViT(nn.Module):
    """``images [B, H, W, C] -> logits [B, classes]``."""

    config: ViTConfig

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        cfg = self.config
        b = images.shape[0]
        x = _dense(cfg.hidden, "patch_embed", cfg.dtype)(patchify(images, cfg.patch))
        cls = self.param("cls", nn.initializers.zeros, (1, 1, cfg.hidden), cfg.dtype)
        pos = self.param(
            "pos_embed",
            nn.initializers.normal(_INIT_STD),
            (1, cfg.patches + 1, cfg.hidden),
            cfg.dtype,
        )
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, cfg.hidden)), x], axis=1) + pos
        for i in range(cfg.layers):
            x = gpt.Block(cfg, causal=False, name=f"h_{i}")(x)
        x = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name="ln_f")(x)
        return _dense(cfg.classes, "head", cfg.dtype)(x[:, 0])


def make_batch(config: ViTConfig, seed: int) -> Batch:
    """``{"images": [B, H, W, C] in [-0.75, 0.75], "labels": [B] int32}``, position-dependent."""
    shape = (config.batch_size, config.image, config.image, config.channels)
    n = math.prod(shape)
    v = (jnp.arange(n, dtype=jnp.int32) * 13 + seed * 5) % 97
    images = (v.astype(jnp.float32) / 64.0 - 0.75).reshape(shape)
    labels = (jnp.arange(config.batch_size, dtype=jnp.int32) * 3 + seed) % config.classes
    return {"images": images.astype(config.dtype), "labels": labels}


def make_train_step(config: ViTConfig, learning_rate: float = 1e-2) -> TrainStep:
    """AdamW train step for :class:`ViT` with softmax cross-entropy."""
    model = ViT(config)

    def init_params(seed: int) -> PyTree:
        dummy = jnp.zeros(
            (config.batch_size, config.image, config.image, config.channels), config.dtype
        )
        return model.init(jax.random.key(seed), dummy)["params"]

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        logits = model.apply({"params": params}, batch["images"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return simple_train_step(
        "vit", loss_fn, init_params, functools.partial(make_batch, config), learning_rate
    )


def abstract_args(config: ViTConfig) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` for ``make_train_step(config).step``, without allocation."""
    return abstract_args_of(make_train_step(config))
