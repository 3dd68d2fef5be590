"""Shared pieces of the example models: the ``TrainStep`` bundle and helpers.

Every model module (``gpt``, ``cnn``, ``mlp``, ``embedding``) exposes

* ``make_train_step(config, learning_rate=1e-2) -> TrainStep``
* ``abstract_args(config) -> (state_sds, batch_sds)``

where the abstract arguments are pytrees of :class:`jax.ShapeDtypeStruct`
computed with :func:`jax.eval_shape`, so arbitrarily large configurations can be
traced (e.g. with :func:`jax.make_jaxpr`) without allocating device memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
State = dict[str, Any]
Batch = dict[str, Any]

WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class TrainStep:
    """A model's pure training functions.

    Attributes:
        step: ``step(state, batch) -> (new_state, {"loss": loss})``; one AdamW step.
        init: ``init(seed) -> state``; ``state`` is ``{"params", "opt_state"}``
            (plus ``"batch_stats"`` for models with batch normalization).
        batch: ``batch(seed) -> batch``; a deterministic, position-dependent batch.
        loss: ``loss(state, batch) -> scalar``; the forward loss only.
        name: a short human-readable model name.
    """

    step: Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]
    init: Callable[[int], State]
    batch: Callable[[int], Batch]
    loss: Callable[[State, Batch], jax.Array]
    name: str


def make_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """The optimizer used by every example model: AdamW with weight decay 0.01."""
    return optax.adamw(learning_rate, weight_decay=WEIGHT_DECAY)


def abstract(tree: PyTree) -> PyTree:
    """Map every leaf (array, scalar or ``ShapeDtypeStruct``) to a ``ShapeDtypeStruct``."""

    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        arr = np.asarray(x)
        return jax.ShapeDtypeStruct(arr.shape, arr.dtype)

    return jax.tree.map(leaf, tree)


def abstract_args_of(ts: TrainStep, seed: int = 0) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` of a train step, via ``jax.eval_shape`` (no allocation)."""
    state = jax.eval_shape(functools.partial(ts.init, seed))
    batch = jax.eval_shape(functools.partial(ts.batch, seed))
    return state, batch


def simple_train_step(
    name: str,
    loss_fn: Callable[[PyTree, Batch], jax.Array],
    init_params: Callable[[int], PyTree],
    make_batch: Callable[[int], Batch],
    learning_rate: float,
) -> TrainStep:
    """Build a :class:`TrainStep` for a model whose only state is its parameters.

    Args:
        name: model name.
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        init_params: ``init_params(seed) -> params``.
        make_batch: ``make_batch(seed) -> batch``.
        learning_rate: AdamW learning rate.
    """
    tx = make_optimizer(learning_rate)

    def init(seed: int) -> State:
        params = init_params(seed)
        return {"params": params, "opt_state": tx.init(params)}

    def loss(state: State, batch: Batch) -> jax.Array:
        return loss_fn(state["params"], batch)

    def step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        params = state["params"]
        value, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, updates)
        return {"params": params, "opt_state": opt_state}, {"loss": value}

    return TrainStep(step=step, init=init, batch=make_batch, loss=loss, name=name)


def image_batch(config: Any, seed: int) -> Batch:
    """``{"images": [B, H, W, C] in [-0.75, 0.75], "labels": [B] int32}``, position-dependent.
    `config` has ``batch_size``, ``image``, ``channels``, ``classes`` and ``dtype``."""
    shape = (config.batch_size, config.image, config.image, config.channels)
    v = (jnp.arange(int(np.prod(shape)), dtype=jnp.int32) * 13 + seed * 5) % 97
    # Power-of-two scale keeps the values exact (identical under jit and eagerly).
    images = (v.astype(jnp.float32) / 64.0 - 0.75).reshape(shape)
    labels = (jnp.arange(config.batch_size, dtype=jnp.int32) * 3 + seed) % config.classes
    return {"images": images.astype(config.dtype), "labels": labels}


def batch_norm_train_step(name: str, model: Any, config: Any, learning_rate: float) -> TrainStep:
    """AdamW train step for an image classifier with BatchNorm (`model.apply` takes
    images, mutates ``batch_stats``). ``state`` has ``params``, ``batch_stats``,
    ``opt_state``; the batch comes from :func:`image_batch`."""
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
        step=step, init=init, batch=functools.partial(image_batch, config), loss=loss, name=name
    )
