"""A GShard-style mixture-of-experts transformer (decoder, pre-LN, MoE every other layer).

The MoE layer is the GShard formulation (Lepikhin et al. 2020, Algorithm 1/2): tokens are
split into groups of ``group_size``; a top-2 gate with expert capacity
``C = ceil(2 * group_size * capacity_factor / experts)`` builds one-hot ``dispatch``
and weighted ``combine`` tensors ``[G, S, E, C]``, and the experts run as one batched
einsum over the expert dimension::

    gates      = softmax(einsum("GSM,ME->GSE", x, wg))
    dispatched = einsum("GSEC,GSM->EGCM", dispatch, x)
    h          = gelu(einsum("EGCM,EMH->EGCH", dispatched, wi))
    out        = einsum("EGCH,EHM->EGCM", h, wo)
    y          = einsum("GSEC,EGCM->GSM", combine, out)

Sharding ``E`` and ``G`` on different mesh axes turns the dispatch/combine einsums into
all-to-alls (expert parallelism). The train loss adds GShard's load-balancing term
``aux_loss_weight * mean(me * ce) * E^2``.

Parameter paths (layer ``i``; odd layers are MoE, even layers dense)::

    params/wte/embedding                 [vocab, hidden]
    params/wpe                           [seq, hidden]
    params/h_i/ln_1/{scale,bias}
    params/h_i/attn/{q,k,v,o}/{kernel,bias}     (same as autopar.examples.models.gpt)
    params/h_i/ln_2/{scale,bias}
    params/h_i/mlp/{c_fc,c_proj}/{kernel,bias}  (dense layers)
    params/h_i/moe/wg                    [hidden, experts]
    params/h_i/moe/wi                    [experts, hidden, ffn]
    params/h_i/moe/wo                    [experts, ffn, hidden]
    params/ln_f/{scale,bias}
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
class MoEConfig:
    """MoE transformer hyper-parameters. ``ffn=None`` means ``4 * hidden``.

    ``group_size`` is GShard's expert group (tokens routed together); ``batch_size *
    seq`` must be a multiple of it. ``moe_every=2`` puts an MoE layer at every odd
    layer index (GShard: every other layer).
    """

    vocab: int = 256
    seq: int = 32
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = 4
    ffn: int | None = None
    group_size: int = 32
    capacity_factor: float = 1.0
    moe_every: int = 2
    aux_loss_weight: float = 0.01
    dtype: Any = jnp.float32
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} not divisible by heads={self.heads}")
        if (self.batch_size * self.seq) % self.group_size:
            raise ValueError(
                f"batch_size*seq={self.batch_size * self.seq} not divisible by group_size={self.group_size}"
            )

    @property
    def ffn_dim(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def capacity(self) -> int:
        """Expert capacity per group (top-2: twice the fair share, times the factor)."""
        return max(1, math.ceil(2 * self.group_size * self.capacity_factor / self.experts))

    @property
    def num_groups(self) -> int:
        return self.batch_size * self.seq // self.group_size

    def is_moe(self, layer: int) -> bool:
        return layer % self.moe_every == self.moe_every - 1

    def gpt_config(self) -> gpt.GPTConfig:
        """The attention / dense-MLP shapes, as a GPTConfig (reuses gpt's modules)."""
        return gpt.GPTConfig(
            vocab=self.vocab,
            seq=self.seq,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            ffn=self.ffn,
            dtype=self.dtype,
            batch_size=self.batch_size,
        )


def top2_gating(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating. ``gates [G, S, E]`` (softmax probabilities, float32).

    Returns ``(combine [G, S, E, C] float32, dispatch [G, S, E, C] bool, aux_loss)``.
    A token's second choice is queued behind every first choice of its group; tokens
    past an expert's capacity are dropped (their combine weight is 0).
    """
    e = gates.shape[-1]
    index1 = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(index1, e, dtype=gates.dtype)
    gates_wo1 = gates * (1.0 - mask1)
    index2 = jnp.argmax(gates_wo1, axis=-1)
    mask2 = jax.nn.one_hot(index2, e, dtype=gates.dtype)

    # Load-balancing loss: fraction of tokens routed (first choice) x mean gate.
    me = jnp.mean(gates, axis=1)
    ce = jnp.mean(mask1, axis=1)
    aux_loss = jnp.mean(me * ce) * e * e

    # Position of each token in its expert's buffer; drop what does not fit.
    pos1 = jnp.cumsum(mask1, axis=1) - 1.0
    mask1 = mask1 * (pos1 < capacity)
    pos2 = jnp.cumsum(mask2, axis=1) - 1.0 + jnp.sum(mask1, axis=1, keepdims=True)
    mask2 = mask2 * (pos2 < capacity)

    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = jnp.maximum(gate1 + gate2, jnp.finfo(gates.dtype).eps)
    gate1, gate2 = gate1 / denom, gate2 / denom

    loc1 = jnp.sum(pos1 * mask1, axis=-1).astype(jnp.int32)
    loc2 = jnp.sum(pos2 * mask2, axis=-1).astype(jnp.int32)
    slot1 = jax.nn.one_hot(loc1, capacity, dtype=gates.dtype)
    slot2 = jax.nn.one_hot(loc2, capacity, dtype=gates.dtype)
    combine = (
        gate1[..., None, None] * mask1[..., None] * slot1[:, :, None, :]
        + gate2[..., None, None] * mask2[..., None] * slot2[:, :, None, :]
    )
    return combine, combine > 0, aux_loss


class MoELayer(nn.Module):
    """GShard MoE feed-forward layer: ``x [B, S, M] -> (y [B, S, M], aux_loss)``."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        b, s, m = x.shape
        e, h, c = cfg.experts, cfg.ffn_dim, cfg.capacity
        init = nn.initializers.normal(_INIT_STD)
        wg = self.param("wg", init, (m, e), cfg.dtype)
        wi = self.param("wi", init, (e, m, h), cfg.dtype)
        wo = self.param("wo", init, (e, h, m), cfg.dtype)

        xg = x.reshape(b * s // cfg.group_size, cfg.group_size, m)
        logits = jnp.einsum("GSM,ME->GSE", xg, wg).astype(jnp.float32)
        combine, dispatch, aux = top2_gating(jax.nn.softmax(logits, axis=-1), c)
        dispatched = jnp.einsum("GSEC,GSM->EGCM", dispatch.astype(cfg.dtype), xg)
        hidden = nn.gelu(jnp.einsum("EGCM,EMH->EGCH", dispatched, wi))
        out = jnp.einsum("EGCH,EHM->EGCM", hidden, wo)
        y = jnp.einsum("GSEC,EGCM->GSM", combine.astype(cfg.dtype), out)
        return y.reshape(b, s, m), aux


class MoEBlock(nn.Module):
    """Pre-LN block whose feed-forward is an MoE layer (or gpt's dense MLP)."""

    config: MoEConfig
    moe: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        ln = functools.partial(nn.LayerNorm, dtype=cfg.dtype, param_dtype=cfg.dtype)
        x = x + gpt.SelfAttention(cfg.gpt_config(), name="attn")(ln(name="ln_1")(x))
        y = ln(name="ln_2")(x)
        if self.moe:
            y, aux = MoELayer(cfg, name="moe")(y)
        else:
            y, aux = gpt.MLP(cfg.gpt_config(), name="mlp")(y), jnp.zeros((), jnp.float32)
        return x + y, aux


class MoETransformer(nn.Module):
    """``tokens [B, S] -> (logits [B, S, vocab], summed aux loss)``; tied embeddings."""

    config: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        x, wte = gpt.embed_tokens(self, cfg, tokens)
        aux = jnp.zeros((), jnp.float32)
        for i in range(cfg.layers):
            x, a = MoEBlock(cfg, cfg.is_moe(i), name=f"h_{i}")(x)
            aux = aux + a
        x = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name="ln_f")(x)
        return wte.attend(x), aux


def make_batch(config: MoEConfig, seed: int) -> Batch:
    """Next-token batch ``{"inputs", "targets"}`` ``[B, S]`` int32, position-dependent."""
    b, s = config.batch_size, config.seq
    stream = (jnp.arange(b * (s + 1), dtype=jnp.int32).reshape(b, s + 1) * 7 + seed) % config.vocab
    # A second, coprime stride so tokens are not a pure function of position mod vocab.
    stream = (stream + (jnp.arange(b * (s + 1), dtype=jnp.int32) // 3).reshape(b, s + 1)) % (
        config.vocab
    )
    return {"inputs": stream[:, :-1], "targets": stream[:, 1:]}


def make_train_step(config: MoEConfig, learning_rate: float = 1e-2) -> TrainStep:
    """AdamW train step: token cross-entropy + ``aux_loss_weight`` x load-balancing loss."""
    model = MoETransformer(config)

    def init_params(seed: int) -> PyTree:
        dummy = jnp.zeros((config.batch_size, config.seq), jnp.int32)
        return model.init(jax.random.key(seed), dummy)["params"]

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        logits, aux = model.apply({"params": params}, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["targets"]
        ).mean()
        return ce + config.aux_loss_weight * aux

    return simple_train_step(
        "moe", loss_fn, init_params, functools.partial(make_batch, config), learning_rate
    )


def abstract_args(config: MoEConfig) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` for ``make_train_step(config).step``, without allocation."""
    return abstract_args_of(make_train_step(config))
