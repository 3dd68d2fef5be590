"""Train steps written as public Flax code writes them, for ``benchmarks.user_models``.

Each builder takes a config dict and returns a :class:`Case`: the step (what a user would
hand to ``jax.jit``), a function making its arguments from a key, which arguments are
train state (returned, in that order, before the loss) and which are the batch. Layer
names follow the code they imitate (``transformers``' Flax GPT-2, BERT and Llama, T5X,
``google-research/vision_transformer``, the Flax ImageNet example, the README's NNX
step), so that ``benchmarks.baselines``' Megatron rule finds them the way a person
writing the layout by hand would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state


@dataclass
class Case:
    step: Callable  # what autopar.parallelize gets
    make_args: Callable[[jax.Array], tuple]  # concrete arguments from a key
    state_argnums: tuple[int, ...]  # step returns (*new state in this order, loss)
    batch_argnums: tuple[int, ...]
    nnx: bool = False  # step(model, optimizer, ...) updates in place, returns the loss

    def args(self, concrete: bool) -> tuple:
        key = jax.random.key(0)
        if concrete:
            return self.make_args(key)
        if self.nnx:  # abstract modules: nnx.eval_shape keeps the objects
            return nnx.eval_shape(lambda: self.make_args(key))
        return jax.eval_shape(self.make_args, key)

    def functional(self, args: tuple) -> tuple[Callable, tuple, tuple, tuple]:
        """``(fn, args, state_argnums, batch_argnums)`` as plain ``jax.jit`` takes them:
        the step itself, or for NNX the ``nnx.split``/``nnx.merge`` form public code
        writes around ``jax.jit``."""
        if not self.nnx:
            return self.step, args, self.state_argnums, self.batch_argnums
        graphdef, state = nnx.split((args[0], args[1]))

        def fn(state, *batch):
            model, optimizer = nnx.merge(graphdef, state)
            loss = self.step(model, optimizer, *batch)
            return nnx.state((model, optimizer)), loss

        return fn, (state, *args[2:]), (0,), tuple(range(1, len(args) - 1))


def _ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _ids(key, b, s, vocab):
    return jax.random.randint(key, (b, s), 0, vocab)


# ------------------------------------------------------------------ 1. linen MLP


class MLP(nn.Module):
    hidden: int
    out: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden, name="fc1")(x))
        return nn.Dense(self.out, name="fc2")(x)


def mlp(c: dict) -> Case:
    model, tx = MLP(c["hidden"], c["out"]), optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_args(key):
        x = jax.random.normal(key, (c["batch"], c["din"]))
        y = jax.random.normal(key, (c["batch"], c["out"]))
        params = model.init(key, x)["params"]
        return params, tx.init(params), x, y

    return Case(step, make_args, (0, 1), (2, 3))


# --------------------------------------- 2. BERT-style post-LN encoder, fused qkv, dropout


class BertLayer(nn.Module):
    heads: int
    ffn: int
    rate: float = 0.1

    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        b, s, d = x.shape
        q, k, v = jnp.split(nn.Dense(3 * d, name="qkv")(x), 3, axis=-1)
        heads = lambda t: t.reshape(b, s, self.heads, d // self.heads)
        w = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / jnp.sqrt(d // self.heads)
        w = jnp.where(mask[:, None, None, :] > 0, w, jnp.finfo(w.dtype).min)
        w = nn.Dropout(self.rate)(jax.nn.softmax(w, axis=-1), deterministic=deterministic)
        a = jnp.einsum("bhqk,bkhd->bqhd", w, heads(v)).reshape(b, s, d)
        a = nn.Dropout(self.rate)(nn.Dense(d, name="attn_out")(a), deterministic=deterministic)
        x = nn.LayerNorm(name="attn_ln")(x + a)  # post-LN
        h = nn.Dense(d, name="output")(nn.gelu(nn.Dense(self.ffn, name="intermediate")(x)))
        return nn.LayerNorm(name="out_ln")(x + nn.Dropout(self.rate)(h, deterministic))


class Bert(nn.Module):
    vocab: int
    d: int
    heads: int
    ffn: int
    layers: int
    classes: int = 2

    @nn.compact
    def __call__(self, ids, mask, deterministic: bool = True):
        pos = self.param("position_embeddings", nn.initializers.normal(0.02), (512, self.d))
        x = nn.Embed(self.vocab, self.d, name="word_embeddings")(ids) + pos[: ids.shape[1]]
        x = nn.Dropout(0.1)(nn.LayerNorm(name="emb_ln")(x), deterministic=deterministic)
        for i in range(self.layers):
            x = BertLayer(self.heads, self.ffn, name=f"layer_{i}")(x, mask, deterministic)
        pooled = nn.tanh(nn.Dense(self.d, name="pooler")(x[:, 0]))
        return nn.Dense(self.classes, name="classifier")(pooled)


def bert(c: dict) -> Case:
    model = Bert(c["vocab"], c["d"], c["heads"], c["ffn"], c["layers"])

    def train_step(state, batch, dropout_rng):
        def loss_fn(params):
            logits = state.apply_fn(
                {"params": params},
                batch["input_ids"],
                batch["attention_mask"],
                deterministic=False,
                rngs={"dropout": dropout_rng},
            )
            return _ce(logits, batch["labels"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def make_args(key):
        ids = _ids(key, c["batch"], c["seq"], c["vocab"])
        batch = {
            "input_ids": ids,
            "attention_mask": jnp.ones_like(ids),
            "labels": ids[:, 0] % 2,
        }
        params = model.init(key, ids, batch["attention_mask"])["params"]
        tx = optax.adamw(2e-5, weight_decay=0.01)
        state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        return state, batch, jax.random.key(1)

    return Case(train_step, make_args, (0,), (1,))


# -------------------------------------------- 3. GPT-2 (pre-LN, h_i, fused c_attn, wpe)


class GPT2Attention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        q, k, v = jnp.split(nn.Dense(3 * d, name="c_attn")(x), 3, axis=-1)
        heads = lambda t: t.reshape(b, s, self.heads, -1).transpose(0, 2, 1, 3)
        q, k, v = heads(q), heads(k), heads(v)
        w = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(q.shape[-1])
        w = jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, jnp.finfo(w.dtype).min)
        a = (jax.nn.softmax(w, -1) @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        return nn.Dense(d, name="c_proj")(a)


class GPT2MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(4 * x.shape[-1], name="c_fc")(x), approximate=True)
        return nn.Dense(x.shape[-1], name="c_proj")(h)


class GPT2Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        x = x + GPT2Attention(self.heads, name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + GPT2MLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT2ScanBlock(nn.Module):
    """A block as `nn.scan` calls it: (carry, x) -> (carry, y)."""

    heads: int

    @nn.compact
    def __call__(self, x, _):
        return GPT2Block(self.heads, name="block")(x), None


class GPT2(nn.Module):
    vocab: int
    d: int
    heads: int
    layers: int
    max_len: int = 1024
    scan: bool = False  # the layers under `nn.scan` (MaxText-style), one stacked block

    @nn.compact
    def __call__(self, ids):
        wte = nn.Embed(self.vocab, self.d, name="wte")
        x = wte(ids) + nn.Embed(self.max_len, self.d, name="wpe")(jnp.arange(ids.shape[1]))
        if self.scan:
            layers = nn.scan(
                GPT2ScanBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
            )
            x, _ = layers(self.heads, name="h")(x, None)
        else:
            for i in range(self.layers):
                x = GPT2Block(self.heads, name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(name="ln_f")(x))  # tied LM head


def _lm_step(model, tx):
    """``step(params, opt_state, batch)``: next-token loss on ``batch["input_ids"]``."""

    def step(params, opt_state, batch):
        def loss_fn(p):
            ids = batch["input_ids"]
            logits = model.apply({"params": p}, ids[:, :-1])
            return _ce(logits, ids[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_args(key, c):
        ids = _ids(key, c["batch"], c["seq"] + 1, c["vocab"])
        params = model.init(key, ids[:, :-1])["params"]
        return params, tx.init(params), {"input_ids": ids}

    return step, make_args


def gpt2(c: dict) -> Case:
    model = GPT2(c["vocab"], c["d"], c["heads"], c["layers"], scan=c.get("scan", False))
    step, make = _lm_step(model, optax.adamw(3e-4, b2=0.95, weight_decay=0.1))
    return Case(step, lambda key: make(key, c), (0, 1), (2,))


# ------------------------------------------------- 4. Llama (RoPE, GQA, RMSNorm, SwiGLU)


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps) * w


def rope(x, positions, theta=10000.0):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, hd, 2) / hd)
    ang = positions[:, None].astype(jnp.float32) * inv  # [s, hd/2]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class LlamaAttention(nn.Module):
    heads: int
    kv_heads: int

    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        hd = d // self.heads
        dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)
        q = dense(self.heads * hd, "q_proj")(x).reshape(b, s, self.heads, hd)
        k = dense(self.kv_heads * hd, "k_proj")(x).reshape(b, s, self.kv_heads, hd)
        v = dense(self.kv_heads * hd, "v_proj")(x).reshape(b, s, self.kv_heads, hd)
        pos = jnp.arange(s)
        q, k = rope(q, pos), rope(k, pos)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
        w = jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, jnp.finfo(w.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, -1), v).reshape(b, s, d)
        return dense(d, "o_proj")(out)


class LlamaLayer(nn.Module):
    heads: int
    kv_heads: int
    ffn: int

    @nn.compact
    def __call__(self, x):
        attn = LlamaAttention(self.heads, self.kv_heads, name="self_attn")
        x = x + attn(RMSNorm(name="input_layernorm")(x))
        h = RMSNorm(name="post_attention_layernorm")(x)
        gate = nn.Dense(self.ffn, use_bias=False, name="gate_proj")(h)
        up = nn.Dense(self.ffn, use_bias=False, name="up_proj")(h)
        return x + nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(nn.silu(gate) * up)


class Llama(nn.Module):
    vocab: int
    d: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d, name="embed_tokens")(ids)
        for i in range(self.layers):
            x = LlamaLayer(self.heads, self.kv_heads, self.ffn, name=f"layers_{i}")(x)
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(RMSNorm(name="norm")(x))


def llama(c: dict) -> Case:
    model = Llama(c["vocab"], c["d"], c["heads"], c["kv_heads"], c["ffn"], c["layers"])
    step, make = _lm_step(model, optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    return Case(step, lambda key: make(key, c), (0, 1), (2,))


# ----------------------------------- 5. ResNet-ish CNN with BatchNorm (Flax ImageNet style)


class ResNetBlock(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda name: nn.BatchNorm(use_running_average=not train, momentum=0.9, name=name)
        y = nn.relu(norm("bn_0")(nn.Conv(self.filters, (3, 3), self.strides, name="conv_0")(x)))
        y = norm("bn_1")(nn.Conv(self.filters, (3, 3), name="conv_1")(y))
        if x.shape != y.shape:
            x = norm("bn_proj")(nn.Conv(self.filters, (1, 1), self.strides, name="proj")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    width: int
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.width, (3, 3), name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, name="bn_init")(x))
        for i, mult in enumerate((1, 2, 4)):
            x = ResNetBlock(self.width * mult, 1 if i == 0 else 2, name=f"block_{i}")(x, train)
        return nn.Dense(self.classes, name="head")(jnp.mean(x, axis=(1, 2)))


class BNTrainState(train_state.TrainState):
    batch_stats: Any


def resnet(c: dict) -> Case:
    model = ResNet(c["width"])

    def train_step(state, batch):
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                batch["image"],
                mutable=["batch_stats"],
            )
            return _ce(logits, batch["label"]), updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
        return state, loss

    def make_args(key):
        image = jax.random.normal(key, (c["batch"], c["res"], c["res"], 3))
        variables = model.init(key, image)
        state = BNTrainState.create(
            apply_fn=model.apply,
            params=variables["params"],
            tx=optax.sgd(0.1, momentum=0.9, nesterov=True),
            batch_stats=variables["batch_stats"],
        )
        return state, {"image": image, "label": jax.random.randint(key, (c["batch"],), 0, 10)}

    return Case(train_step, make_args, (0,), (1,))


# ---------------------------------------------- 6. MobileNet-style depthwise separable conv


class DepthwiseSeparable(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        c = x.shape[-1]
        x = nn.Conv(c, (3, 3), self.strides, feature_group_count=c, use_bias=False, name="dw")(x)
        x = nn.relu6(nn.BatchNorm(use_running_average=not train, name="dw_bn")(x))
        x = nn.Conv(self.filters, (1, 1), use_bias=False, name="pw")(x)
        return nn.relu6(nn.BatchNorm(use_running_average=not train, name="pw_bn")(x))


class MobileNet(nn.Module):
    width: int
    classes: int = 100

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.width, (3, 3), 2, use_bias=False, name="stem")(x)
        x = nn.relu6(nn.BatchNorm(use_running_average=not train, name="stem_bn")(x))
        for i, (mult, stride) in enumerate(((2, 1), (4, 2), (4, 1), (8, 2))):
            x = DepthwiseSeparable(self.width * mult, stride, name=f"ds_{i}")(x, train)
        return nn.Dense(self.classes, name="head")(jnp.mean(x, axis=(1, 2)))


def mobilenet(c: dict) -> Case:
    model, tx = MobileNet(c["width"]), optax.adamw(1e-3)

    def step(params, batch_stats, opt_state, images, labels):
        def loss_fn(p):
            logits, mutated = model.apply(
                {"params": p, "batch_stats": batch_stats}, images, mutable=["batch_stats"]
            )
            return _ce(logits, labels), mutated["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    def make_args(key):
        images = jax.random.normal(key, (c["batch"], c["res"], c["res"], 3))
        v = model.init(key, images)
        labels = jax.random.randint(key, (c["batch"],), 0, 100)
        return v["params"], v["batch_stats"], tx.init(v["params"]), images, labels

    return Case(step, make_args, (0, 1, 2), (3, 4))


# ---------------------------------------------- 7. top-2 MoE, einsum dispatch and combine


def top2_routing(gates, capacity: int):
    """GShard's top-2 gating: ``(dispatch, combine)`` of shape [batch, seq, experts,
    capacity], tokens over capacity dropped (per sequence)."""
    e = gates.shape[-1]
    m1 = jax.nn.one_hot(jnp.argmax(gates, -1), e)
    m2 = jax.nn.one_hot(jnp.argmax(gates * (1 - m1), -1), e)
    pos1 = jnp.cumsum(m1, axis=1) - m1
    m1 = m1 * (pos1 < capacity)
    pos2 = jnp.cumsum(m2, axis=1) - m2 + jnp.sum(m1, axis=1, keepdims=True)
    m2 = m2 * (pos2 < capacity)
    g1, g2 = jnp.sum(gates * m1, -1), jnp.sum(gates * m2, -1)
    g1, g2 = g1 / (g1 + g2 + 1e-9), g2 / (g1 + g2 + 1e-9)
    slot = lambda pos, m: jax.nn.one_hot(jnp.sum(pos * m, -1).astype(jnp.int32), capacity)
    combine = (g1[..., None, None] * m1[..., None] * slot(pos1, m1)[..., None, :]) + (
        g2[..., None, None] * m2[..., None] * slot(pos2, m2)[..., None, :]
    )
    return (combine > 0).astype(gates.dtype), combine


class MoE(nn.Module):
    experts: int
    hidden: int
    capacity_factor: float = 2.0

    @nn.compact
    def __call__(self, x):
        b, s, m = x.shape
        init = nn.initializers.lecun_normal()
        wg = self.param("wg", init, (m, self.experts))
        wi = self.param("wi", init, (self.experts, m, self.hidden))
        wo = self.param("wo", init, (self.experts, self.hidden, m))
        gates = jax.nn.softmax(x @ wg, axis=-1)
        capacity = int(self.capacity_factor * s * 2 / self.experts)
        dispatch, combine = top2_routing(gates, capacity)
        xe = jnp.einsum("bsec,bsm->becm", dispatch, x)
        h = nn.relu(jnp.einsum("becm,emh->bech", xe, wi))
        ye = jnp.einsum("bech,ehm->becm", h, wo)
        y = jnp.einsum("bsec,becm->bsm", combine, ye)
        density = jnp.mean(dispatch.sum(-1) > 0, axis=(0, 1))  # load-balancing loss
        aux = jnp.mean(density * jnp.mean(gates, axis=(0, 1))) * self.experts**2
        return y, aux


class MoELM(nn.Module):
    vocab: int
    d: int
    experts: int
    hidden: int

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d, name="wte")(ids)
        y, aux = MoE(self.experts, self.hidden, name="moe")(nn.LayerNorm(name="ln_1")(x))
        x = x + y
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="ln_f")(x)), aux


def moe(c: dict) -> Case:
    model, tx = MoELM(c["vocab"], c["d"], c["experts"], c["hidden"]), optax.adamw(1e-3)

    def step(params, opt_state, batch):
        def loss_fn(p):
            ids = batch["input_ids"]
            logits, aux = model.apply({"params": p}, ids[:, :-1])
            return _ce(logits, ids[:, 1:]) + 0.01 * aux

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_args(key):
        ids = _ids(key, c["batch"], c["seq"] + 1, c["vocab"])
        params = model.init(key, ids[:, :-1])["params"]
        return params, tx.init(params), {"input_ids": ids}

    return Case(step, make_args, (0, 1), (2,))


# ------------------------------------- 8. embedding-heavy recommender (two-tower-ish MLP)


class Recommender(nn.Module):
    users: int
    items: int
    dim: int

    @nn.compact
    def __call__(self, user, item, dense):
        u = nn.Embed(self.users, self.dim, name="user_embed")(user)
        i = nn.Embed(self.items, self.dim, name="item_embed")(item)
        h = jnp.concatenate([u, i, u * i, dense], axis=-1)
        h = nn.relu(nn.Dense(256, name="mlp_0")(h))
        h = nn.relu(nn.Dense(64, name="mlp_1")(h))
        return nn.Dense(1, name="logit")(h)[..., 0]


def recsys(c: dict) -> Case:
    model, tx = Recommender(c["users"], c["items"], c["dim"]), optax.adam(1e-3)

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["user"], batch["item"], batch["dense"])
            return optax.sigmoid_binary_cross_entropy(logits, batch["click"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_args(key):
        b = c["batch"]
        batch = {
            "user": jax.random.randint(key, (b,), 0, c["users"]),
            "item": jax.random.randint(jax.random.fold_in(key, 1), (b,), 0, c["items"]),
            "dense": jax.random.normal(key, (b, 13)),
            "click": (jax.random.uniform(key, (b,)) < 0.1).astype(jnp.float32),
        }
        params = model.init(key, batch["user"], batch["item"], batch["dense"])["params"]
        return params, tx.init(params), batch

    return Case(step, make_args, (0, 1), (2,))


# ----------------------------------------------------- 9. T5-style encoder-decoder


class T5Attention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x, kv, causal: bool = False):
        b, s, d = x.shape
        dense = lambda name: nn.Dense(d, use_bias=False, name=name)
        heads = lambda t: t.reshape(b, -1, self.heads, d // self.heads)
        q, k, v = heads(dense("q")(x)), heads(dense("k")(kv)), heads(dense("v")(kv))
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # T5: no 1/sqrt(d) scaling
        if causal:
            w = jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, jnp.finfo(w.dtype).min)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, -1), v).reshape(b, s, d)
        return dense("o")(a)


class T5FF(nn.Module):
    ffn: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.ffn, use_bias=False, name="wi")(x))
        return nn.Dense(x.shape[-1], use_bias=False, name="wo")(h)


class T5(nn.Module):
    vocab: int
    d: int
    heads: int
    ffn: int
    layers: int

    @nn.compact
    def __call__(self, enc_ids, dec_ids):
        shared = nn.Embed(self.vocab, self.d, name="shared")
        x = shared(enc_ids)
        for i in range(self.layers):
            n = lambda k, i=i: RMSNorm(name=f"enc_{i}_ln_{k}")
            h = n(0)(x)
            x = x + T5Attention(self.heads, name=f"encoder_{i}_SelfAttention")(h, h)
            x = x + T5FF(self.ffn, name=f"encoder_{i}_DenseReluDense")(n(1)(x))
        enc = RMSNorm(name="encoder_final_ln")(x)
        y = shared(dec_ids)
        for i in range(self.layers):
            n = lambda k, i=i: RMSNorm(name=f"dec_{i}_ln_{k}")
            h = n(0)(y)
            y = y + T5Attention(self.heads, name=f"decoder_{i}_SelfAttention")(h, h, True)
            y = y + T5Attention(self.heads, name=f"decoder_{i}_EncDecAttention")(n(1)(y), enc)
            y = y + T5FF(self.ffn, name=f"decoder_{i}_DenseReluDense")(n(2)(y))
        y = RMSNorm(name="decoder_final_ln")(y) * self.d**-0.5
        return shared.attend(y)


def t5(c: dict) -> Case:
    model, tx = T5(c["vocab"], c["d"], c["heads"], c["ffn"], c["layers"]), optax.adafactor(1e-3)

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["inputs"], batch["decoder_inputs"])
            return _ce(logits, batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_args(key):
        b, s, v = c["batch"], c["seq"], c["vocab"]
        tgt = _ids(jax.random.fold_in(key, 1), b, s, v)
        batch = {
            "inputs": _ids(key, b, s, v),
            "decoder_inputs": jnp.pad(tgt[:, :-1], ((0, 0), (1, 0))),
            "targets": tgt,
        }
        params = model.init(key, batch["inputs"], batch["decoder_inputs"])["params"]
        return params, tx.init(params), batch

    return Case(step, make_args, (0, 1), (2,))


# ---------------------------------------------------- 10. ViT (patch embedding + encoder)


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.mlp_dim, name="fc1")(x))
        return nn.Dense(x.shape[-1], name="fc2")(h)


class Encoder1DBlock(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="LayerNorm_0")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(h, h)
        return x + MlpBlock(self.mlp_dim, name="MlpBlock_0")(nn.LayerNorm(name="LayerNorm_2")(x))


class ViT(nn.Module):
    patch: int
    d: int
    heads: int
    mlp_dim: int
    layers: int
    classes: int = 1000

    @nn.compact
    def __call__(self, images):
        p = self.patch
        x = nn.Conv(self.d, (p, p), strides=(p, p), padding="VALID", name="embedding")(images)
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, d))
        x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)), x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, h * w + 1, d))
        for i in range(self.layers):
            x = Encoder1DBlock(self.heads, self.mlp_dim, name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(self.classes, name="head")(x[:, 0])


def vit(c: dict) -> Case:
    model = ViT(c["patch"], c["d"], c["heads"], c["mlp"], c["layers"])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-4))

    def step(params, opt_state, images, labels):
        def loss_fn(p):
            return _ce(model.apply({"params": p}, images), labels)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_args(key):
        images = jax.random.normal(key, (c["batch"], c["res"], c["res"], 3))
        params = model.init(key, images)["params"]
        return params, tx.init(params), images, jax.random.randint(key, (c["batch"],), 0, 1000)

    return Case(step, make_args, (0, 1), (2, 3))


# ------------------------------------------------------------- 11. NNX (README's step)


class NNXMLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(din, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.relu(self.fc1(x)))


def nnx_mlp(c: dict) -> Case:
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def make_args(key):
        model = NNXMLP(c["din"], c["hidden"], c["out"], nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        x = jax.random.normal(key, (c["batch"], c["din"]))
        return model, optimizer, x, jax.random.normal(key, (c["batch"], c["out"]))

    return Case(step, make_args, (0, 1), (2, 3), nnx=True)


# ------------------------------------------------------------ 12. tiny: replicate wins


class Tiny(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(self.hidden)(x))
        x = nn.tanh(nn.Dense(self.hidden)(x))
        return nn.Dense(1)(x)


def tiny(c: dict) -> Case:
    model, tx = Tiny(c["hidden"]), optax.sgd(1e-2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: optax.l2_loss(model.apply({"params": p}, x)[:, 0], y).mean()
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_args(key):
        x = jax.random.normal(key, (c["batch"], c["hidden"]))
        params = model.init(key, x)["params"]
        return params, tx.init(params), x, jax.random.normal(key, (c["batch"],))

    return Case(step, make_args, (0, 1), (2, 3))


# --------------------------------------------------------------------- the table

D2M2, D2M4 = {"data": 2, "model": 2}, {"data": 2, "model": 4}
D4, D8 = {"data": 4}, {"data": 8}

# name -> (builder, {config: (cfg, mesh)}, numerics check (small cfg, mesh)). The checks
# are big enough that the plan splits something (smaller ones are planned replicated).
# Config "batch": many samples, a small model (data parallel should win); "wide": few
# samples, wide layers (tensor/parameter splits should win).
MODELS: dict[str, tuple[Callable[[dict], Case], dict[str, tuple[dict, dict]], tuple]] = {
    "mlp": (
        mlp,
        {
            "batch": (dict(batch=8192, din=256, hidden=1024, out=16), D8),
            "wide": (dict(batch=64, din=4096, hidden=16384, out=4096), D2M4),
        },
        (dict(batch=512, din=512, hidden=2048, out=64), D2M4),
    ),
    "bert": (
        bert,
        {
            "batch": (dict(batch=256, seq=128, vocab=8192, d=256, heads=4, ffn=1024, layers=2), D4),
            "wide": (
                dict(batch=8, seq=128, vocab=30522, d=2048, heads=16, ffn=8192, layers=2),
                D2M2,
            ),
        },
        (dict(batch=32, seq=64, vocab=1024, d=256, heads=4, ffn=1024, layers=2), D2M2),
    ),
    "gpt2": (
        gpt2,
        {
            "batch": (dict(batch=64, seq=256, vocab=8192, d=256, heads=4, layers=4), D8),
            "wide": (dict(batch=8, seq=256, vocab=50304, d=2048, heads=16, layers=2), D2M4),
            # GPT-2-medium size, where plain data parallelism fits and is hard to beat
            "medium": (dict(batch=64, seq=1024, vocab=50304, d=1024, heads=16, layers=24), D2M4),
        },
        (dict(batch=16, seq=64, vocab=1024, d=256, heads=4, layers=2), D2M4),
    ),
    # the same model with its layers under `nn.scan`, as MaxText-style code writes them
    "gpt2_scan": (
        gpt2,
        {
            "batch": (dict(batch=64, seq=256, vocab=8192, d=256, heads=4, layers=4, scan=True), D8),
            "wide": (
                dict(batch=8, seq=256, vocab=50304, d=2048, heads=16, layers=2, scan=True),
                D2M4,
            ),
        },
        (dict(batch=16, seq=64, vocab=1024, d=256, heads=4, layers=2, scan=True), D2M4),
    ),
    "llama": (
        llama,
        {
            "batch": (
                dict(batch=64, seq=256, vocab=8192, d=256, heads=8, kv_heads=4, ffn=704, layers=4),
                D4,
            ),
            "wide": (
                dict(
                    batch=8, seq=256, vocab=32000, d=2048, heads=16, kv_heads=4, ffn=5632, layers=2
                ),
                D2M4,
            ),
        },
        (dict(batch=16, seq=64, vocab=1024, d=256, heads=8, kv_heads=4, ffn=704, layers=2), D2M2),
    ),
    "resnet": (
        resnet,
        {
            "batch": (dict(batch=512, res=32, width=32), D8),
            "wide": (dict(batch=16, res=32, width=256), D2M2),
        },
        (dict(batch=32, res=16, width=32), D2M2),
    ),
    "mobilenet": (
        mobilenet,
        {
            "batch": (dict(batch=256, res=64, width=32), D8),
            "wide": (dict(batch=8, res=64, width=256), D2M4),
        },
        (dict(batch=32, res=32, width=32), D2M4),
    ),
    "moe": (
        moe,
        {
            "batch": (dict(batch=64, seq=256, vocab=8192, d=256, experts=8, hidden=512), D8),
            "wide": (dict(batch=8, seq=128, vocab=8192, d=1024, experts=8, hidden=8192), D2M4),
        },
        (dict(batch=16, seq=64, vocab=1024, d=128, experts=4, hidden=512), D2M2),
    ),
    "recsys": (
        recsys,
        {
            "batch": (dict(batch=65536, users=100_000, items=100_000, dim=32), D8),
            "wide": (dict(batch=4096, users=1_000_000, items=4_000_000, dim=64), D2M2),
        },
        (dict(batch=1024, users=20_000, items=50_000, dim=32), D2M2),
    ),
    "t5": (
        t5,
        {
            "batch": (dict(batch=64, seq=128, vocab=8192, d=256, heads=4, ffn=1024, layers=2), D4),
            "wide": (
                dict(batch=8, seq=128, vocab=32128, d=1024, heads=16, ffn=4096, layers=2),
                D2M2,
            ),
        },
        (dict(batch=16, seq=32, vocab=1024, d=128, heads=4, ffn=512, layers=1), D2M2),
    ),
    "vit": (
        vit,
        {
            "batch": (dict(batch=256, res=32, patch=4, d=192, heads=3, mlp=768, layers=4), D8),
            "wide": (dict(batch=16, res=224, patch=16, d=1024, heads=16, mlp=4096, layers=2), D2M4),
        },
        (dict(batch=32, res=32, patch=4, d=128, heads=4, mlp=512, layers=2), D2M4),
    ),
    "nnx_mlp": (
        nnx_mlp,
        {
            "batch": (dict(batch=8192, din=512, hidden=2048, out=16), D4),
            "wide": (dict(batch=32, din=4096, hidden=16384, out=4096), D2M2),
        },
        (dict(batch=512, din=512, hidden=2048, out=64), D2M2),
    ),
    "tiny": (
        tiny,
        {
            "replicate": (dict(batch=8, hidden=32), D8),
            "batch": (dict(batch=65536, hidden=32), D4),
        },
        (dict(batch=8, hidden=32), D8),
    ),
}
