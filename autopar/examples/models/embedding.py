"""An embedding-bag classifier: ``ids [B, bag] -> mean(Embed(ids)) -> Dense -> logits``.

Parameter paths: ``embed/embedding [vocab, dim]`` and ``head/{kernel,bias}``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.examples.models.common import (
    Batch,
    PyTree,
    TrainStep,
    abstract_args_of,
    simple_train_step,
)


@dataclass(frozen=True)
class EmbeddingConfig:
    """Embedding-bag hyper-parameters."""

    vocab: int = 1000
    dim: int = 32
    bag: int = 8
    classes: int = 10
    batch_size: int = 16
    dtype: Any = jnp.float32


class EmbeddingBag(nn.Module):
    """``ids [B, bag] int32 -> logits [B, classes]`` (mean pooling over the bag)."""

    config: EmbeddingConfig

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        cfg = self.config
        common = {"dtype": cfg.dtype, "param_dtype": cfg.dtype}
        emb = nn.Embed(cfg.vocab, cfg.dim, name="embed", **common)(ids)
        pooled = jnp.mean(emb, axis=1)
        return nn.Dense(cfg.classes, name="head", **common)(pooled)


def make_batch(config: EmbeddingConfig, seed: int) -> Batch:
    """``{"ids": [B, bag] int32 in [0, vocab), "labels": [B] int32}``."""
    b = config.batch_size
    ids = (jnp.arange(b * config.bag, dtype=jnp.int32) * 31 + seed * 7) % config.vocab
    labels = (jnp.arange(b, dtype=jnp.int32) * 3 + seed) % config.classes
    return {"ids": ids.reshape(b, config.bag), "labels": labels}


def make_train_step(config: EmbeddingConfig, learning_rate: float = 1e-2) -> TrainStep:
    """AdamW train step for :class:`EmbeddingBag` with cross-entropy loss."""
    model = EmbeddingBag(config)

    def init_params(seed: int) -> PyTree:
        dummy = jnp.zeros((config.batch_size, config.bag), jnp.int32)
        return model.init(jax.random.key(seed), dummy)["params"]

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        logits = model.apply({"params": params}, batch["ids"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return simple_train_step(
        "embedding", loss_fn, init_params, functools.partial(make_batch, config), learning_rate
    )


def abstract_args(config: EmbeddingConfig) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` for ``make_train_step(config).step``, without allocation."""
    return abstract_args_of(make_train_step(config))
