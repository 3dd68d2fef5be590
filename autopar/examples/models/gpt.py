"""A GPT-2 style decoder-only transformer, and a bare MLP block for tensor-parallel tests.

Parameter paths are readable and unrolled per layer, e.g.::

    params/wte/embedding              [vocab, hidden]
    params/wpe                        [seq, hidden]
    params/h_0/ln_1/{scale,bias}
    params/h_0/attn/{q,k,v,o}/{kernel,bias}
    params/h_0/ln_2/{scale,bias}
    params/h_0/mlp/{c_fc,c_proj}/{kernel,bias}
    params/ln_f/{scale,bias}

With ``scan_layers=True`` the layers run under ``nn.scan`` and their parameters are
stacked: ``params/h/block/attn/q/kernel [layers, hidden, hidden]`` and so on.

Output logits reuse the token embedding (``wte.attend``, weight tying).
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

from autopar.examples.models.common import (
    Batch,
    PyTree,
    TrainStep,
    abstract_args_of,
    simple_train_step,
)

_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """GPT hyper-parameters. ``ffn=None`` means ``4 * hidden``.

    ``dtype`` is used both for parameters and for activations; the softmax and the
    loss are always computed in float32.
    """

    vocab: int = 256
    seq: int = 32
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int | None = None
    dtype: Any = jnp.float32
    batch_size: int = 8
    scan_layers: bool = False  # layers under `nn.scan`: params/h/... stacked [layers, ...]

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} not divisible by heads={self.heads}")

    @property
    def ffn_dim(self) -> int:
        """The MLP inner dimension."""
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def head_dim(self) -> int:
        """Per-head dimension ``hidden // heads``."""
        return self.hidden // self.heads


def _dense(features: int, name: str, dtype: Any) -> nn.Dense:
    return nn.Dense(
        features,
        name=name,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nn.initializers.normal(_INIT_STD),
    )


class SelfAttention(nn.Module):
    """Multi-head self-attention written with explicit einsums and a float32 softmax;
    causal by default (GPT), bidirectional with `causal=False` (ViT). `config` is any
    config with `hidden`, `heads`, `head_dim` and `dtype`."""

    config: Any
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        b, s, _ = x.shape
        nh, hd = cfg.heads, cfg.head_dim

        def heads(t: jax.Array) -> jax.Array:
            return t.reshape(b, s, nh, hd)

        # Scale q (b s h d) rather than the scores (b h s s): one less s x s tensor.
        q = heads(_dense(cfg.hidden, "q", cfg.dtype)(x)) / math.sqrt(hd)
        k = heads(_dense(cfg.hidden, "k", cfg.dtype)(x))
        v = heads(_dense(cfg.hidden, "v", cfg.dtype)(x))

        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        if self.causal:
            mask = jnp.tril(jnp.ones((s, s), dtype=bool))
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)

        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.hidden)
        return _dense(cfg.hidden, "o", cfg.dtype)(out)


class MLP(nn.Module):
    """Transformer feed-forward block: ``c_proj(gelu(c_fc(x)))``."""

    config: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = nn.gelu(_dense(cfg.ffn_dim, "c_fc", cfg.dtype)(x))
        return _dense(cfg.hidden, "c_proj", cfg.dtype)(h)


class Block(nn.Module):
    """Pre-LayerNorm transformer block; `causal=False` for an encoder (ViT). `config` is
    any config with `hidden`, `heads`, `head_dim`, `ffn_dim` and `dtype`."""

    config: Any
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        ln = functools.partial(nn.LayerNorm, dtype=cfg.dtype, param_dtype=cfg.dtype)
        x = x + SelfAttention(cfg, self.causal, name="attn")(ln(name="ln_1")(x))
        x = x + MLP(cfg, name="mlp")(ln(name="ln_2")(x))
        return x


def embed_tokens(module: nn.Module, cfg: Any, tokens: jax.Array) -> tuple[jax.Array, nn.Embed]:
    """Token (`wte`, tied with the output layer) plus learned position (`wpe`) embeddings,
    created inside `module`'s compact `__call__`. Returns the embedded tokens and `wte`."""
    wte = nn.Embed(
        cfg.vocab,
        cfg.hidden,
        name="wte",
        dtype=cfg.dtype,
        param_dtype=cfg.dtype,
        embedding_init=nn.initializers.normal(_INIT_STD),
    )
    wpe = module.param(
        "wpe", nn.initializers.normal(_INIT_STD / 2), (cfg.seq, cfg.hidden), cfg.dtype
    )
    return wte(tokens) + wpe[None, : tokens.shape[1], :], wte


class _ScanBlock(nn.Module):
    """`Block` with the `(carry, x) -> (carry, y)` signature `nn.scan` wants."""

    config: Any

    @nn.compact
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
        return Block(self.config, name="block")(x), None


class GPT(nn.Module):
    """GPT-2 style decoder: ``tokens [B, S] int32 -> logits [B, S, vocab]``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        x, wte = embed_tokens(self, cfg, tokens)
        if cfg.scan_layers:
            x, _ = nn.scan(
                _ScanBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.layers,
            )(cfg, name="h")(x, None)
        else:
            for i in range(cfg.layers):
                x = Block(cfg, name=f"h_{i}")(x)
        x = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name="ln_f")(x)
        return wte.attend(x)


def make_batch(config: GPTConfig, seed: int) -> Batch:
    """Next-token prediction batch: ``{"inputs": [B, S], "targets": [B, S]}`` (int32).

    ``targets`` is ``inputs`` shifted left by one position of the same token stream.
    """
    b, s = config.batch_size, config.seq
    stream = (jnp.arange(b * (s + 1), dtype=jnp.int32).reshape(b, s + 1) * 7 + seed) % config.vocab
    return {"inputs": stream[:, :-1], "targets": stream[:, 1:]}


def make_train_step(config: GPTConfig, learning_rate: float = 1e-2) -> TrainStep:
    """AdamW train step for :class:`GPT` with mean token cross-entropy."""
    model = GPT(config)

    def init_params(seed: int) -> PyTree:
        dummy = jnp.zeros((config.batch_size, config.seq), jnp.int32)
        return model.init(jax.random.key(seed), dummy)["params"]

    def loss_fn(params: PyTree, batch: Batch) -> jax.Array:
        logits = model.apply({"params": params}, batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return simple_train_step(
        "gpt",
        loss_fn,
        init_params,
        functools.partial(make_batch, config),
        learning_rate,
    )


def abstract_args(config: GPTConfig) -> tuple[PyTree, PyTree]:
    """``(state_sds, batch_sds)`` for ``make_train_step(config).step``, without allocation."""
    return abstract_args_of(make_train_step(config))


# ---------------------------------------------------------------------------
# Bare MLP block (for tensor-parallel tests): loss = sum(gelu(x @ W1) @ W2).
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MLPBlockConfig:
    """Shapes of the bare MLP block: ``x [batch, seq, hidden]``, ``W1 [hidden, ffn]``,
    ``W2 [ffn, hidden]``."""

    batch: int = 8
    seq: int = 32
    hidden: int = 64
    ffn: int = 256
    dtype: Any = jnp.float32


def mlp_block_init(config: MLPBlockConfig, seed: int = 0) -> dict[str, jax.Array]:
    """Parameters ``{"w1": [hidden, ffn], "w2": [ffn, hidden]}``."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    w1 = jax.random.normal(k1, (config.hidden, config.ffn), config.dtype)
    w2 = jax.random.normal(k2, (config.ffn, config.hidden), config.dtype)
    return {
        "w1": w1 / math.sqrt(config.hidden),
        "w2": w2 / math.sqrt(config.ffn),
    }


def mlp_block_input(config: MLPBlockConfig, seed: int = 0) -> jax.Array:
    """Deterministic, position-dependent input ``x [batch, seq, hidden]`` in ~[-0.8, 0.8] (exact values)."""
    n = config.batch * config.seq * config.hidden
    v = (jnp.arange(n, dtype=jnp.int32) * 37 + seed * 11) % 101
    x = v.astype(jnp.float32) / 64.0 - 0.78125
    return x.reshape(config.batch, config.seq, config.hidden).astype(config.dtype)


def mlp_block_loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Forward: ``sum(gelu(x @ W1) @ W2)`` (a float32 scalar)."""
    h = nn.gelu(x @ params["w1"])
    return jnp.sum((h @ params["w2"]).astype(jnp.float32))


def mlp_block_value_and_grad(
    params: dict[str, jax.Array], x: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Forward + backward: ``(loss, grads w.r.t. params)``."""
    return jax.value_and_grad(mlp_block_loss)(params, x)


def mlp_block_abstract_args(config: MLPBlockConfig) -> tuple[PyTree, jax.ShapeDtypeStruct]:
    """``(params_sds, x_sds)`` for :func:`mlp_block_loss` / :func:`mlp_block_value_and_grad`."""
    params = jax.eval_shape(functools.partial(mlp_block_init, config, 0))
    x = jax.eval_shape(functools.partial(mlp_block_input, config, 0))
    return params, x
