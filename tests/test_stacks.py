"""`autopar.passes.stacks.find_stacks` on models written the way public code writes them:
a linen Llama-style decoder with an optax AdamW step, a GPT-2-style linen model with
dropout and a final LayerNorm, an NNX model with a list of blocks, layers of different
widths, a scanned model, a plain-JAX transformer checked against per-layer named scopes
the pass does not read, an encoder-decoder, and a 48-layer graph for speed."""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close

import autopar
from autopar.ir.capture import capture
from autopar.ir.graph import Graph
from autopar.passes.stacks import Block, LayerStack, find_stacks

# ----------------------------------------------------------------------------- models


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Attention(nn.Module):
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8

    @nn.compact
    def __call__(self, x, mask, cos, sin):
        b, s, d = x.shape
        q = nn.Dense(self.heads * self.head_dim, use_bias=False, name="q_proj")(x)
        k = nn.Dense(self.kv_heads * self.head_dim, use_bias=False, name="k_proj")(x)
        v = nn.Dense(self.kv_heads * self.head_dim, use_bias=False, name="v_proj")(x)
        q = rope(q.reshape(b, s, self.heads, self.head_dim), cos, sin)
        k = rope(k.reshape(b, s, self.kv_heads, self.head_dim), cos, sin)
        v = v.reshape(b, s, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return nn.Dense(d, use_bias=False, name="o_proj")(out.reshape(b, s, -1))


class LlamaBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask, cos, sin):
        x = x + Attention(name="self_attn")(RMSNorm(name="input_layernorm")(x), mask, cos, sin)
        h = RMSNorm(name="post_attention_layernorm")(x)
        gate = nn.Dense(64, use_bias=False, name="gate_proj")(h)
        up = nn.Dense(64, use_bias=False, name="up_proj")(h)
        return x + nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(nn.silu(gate) * up)


class Llama(nn.Module):
    layers: int = 3
    vocab: int = 96
    dim: int = 32
    remat: bool = False  # the user's own nn.remat on every block

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.dim, name="embed_tokens")(ids)
        s = ids.shape[1]
        pos = jnp.broadcast_to(jnp.arange(s), ids.shape)  # position ids, once
        inv = 1.0 / (10000.0 ** (jnp.arange(0, 4) / 4))
        angles = pos[..., None].astype(jnp.float32) * inv
        cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
        mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
        block = nn.remat(LlamaBlock) if self.remat else LlamaBlock
        for i in range(self.layers):
            x = block(name=f"layers_{i}")(x, mask, cos, sin)
        x = RMSNorm(name="norm")(x)
        return nn.Dense(self.vocab, use_bias=False, name="lm_head")(x)


def llama_graphs(layers: int = 3, remat: bool = False) -> tuple[Graph, Graph]:
    """(AdamW train step, forward only) of the linen Llama."""
    model = Llama(layers, remat=remat)
    ids = jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.key(0), ids)
    tx = optax.adamw(1e-3)

    def train_step(params, opt_state, ids):
        def loss_fn(p):
            logits = model.apply(p, ids)[:, :-1]
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train = capture(train_step, (params, tx.init(params), ids))
    return train, capture(lambda params, ids: model.apply(params, ids), (params, ids))


class GPT2Block(nn.Module):
    heads: int = 4

    @nn.compact
    def __call__(self, x, train: bool):
        b, s, d = x.shape
        h = nn.LayerNorm(name="ln_1")(x)
        q, k, v = jnp.split(nn.Dense(3 * d, name="c_attn")(h), 3, axis=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
        att = nn.Dropout(0.1)(jax.nn.softmax(att, -1), deterministic=not train)
        out = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
        x = x + nn.Dropout(0.1)(nn.Dense(d, name="c_proj")(out), deterministic=not train)
        h = nn.Dense(4 * d, name="c_fc")(nn.LayerNorm(name="ln_2")(x))
        h = nn.Dense(d, name="c_proj_mlp")(nn.gelu(h))
        return x + nn.Dropout(0.1)(h, deterministic=not train)


class GPT2(nn.Module):
    layers: int = 3
    vocab: int = 96
    dim: int = 32

    @nn.compact
    def __call__(self, ids, train: bool = False):
        wte = nn.Embed(self.vocab, self.dim, name="wte")
        pos = jnp.arange(ids.shape[1])[None]
        x = wte(ids) + nn.Embed(16, self.dim, name="wpe")(pos)
        x = nn.Dropout(0.1)(x, deterministic=not train)
        for i in range(self.layers):
            x = GPT2Block(name=f"h_{i}")(x, train)
        x = nn.LayerNorm(name="ln_f")(x)
        return wte.attend(x)  # tied head


def gpt2_graph(layers: int = 3) -> Graph:
    model = GPT2(layers)
    ids = jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.key(0), ids)["params"]
    tx = optax.adamw(1e-3)

    def train_step(params, opt_state, ids, rng):
        def loss_fn(p):
            logits = model.apply({"params": p}, ids, True, rngs={"dropout": rng})
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], ids[:, 1:]
            ).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return capture(train_step, (params, tx.init(params), ids, jax.random.key(1)))


class NNXBlock(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.linear = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.out = nnx.Linear(2 * dim, dim, rngs=rngs)

    def __call__(self, x):
        return x + self.out(nnx.gelu(self.linear(self.norm(x))))


class NNXModel(nnx.Module):
    def __init__(self, layers: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Linear(8, dim, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(dim, rngs) for _ in range(layers)])
        self.head = nnx.Linear(dim, 1, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(nnx.relu(x))


def nnx_graphs(layers: int = 3, widths: tuple[int, ...] | None = None) -> tuple[Graph, Graph]:
    """(split/merge + jax.grad train step, forward only) of the NNX model."""
    model = NNXModel(layers, 16, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x, y = jnp.zeros((4, 8)), jnp.zeros((4, 1))

    def train_step(state, x, y):
        def loss_fn(state):
            return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

        grads = jax.grad(loss_fn)(state)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    return capture(train_step, (state, x, y)), capture(forward, (state, x))


class Widening(nn.Module):
    """Unrolled layers of the given widths."""

    widths: tuple[int, ...] = (32, 64)

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, name="stem")(x)  # so that a gradient flows below the first layer
        for i, width in enumerate(self.widths):
            x = nn.relu(nn.Dense(width, name=f"layers_{i}")(x))
        return nn.Dense(1, name="head")(x).sum()


class ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(32, name="mlp")(nn.LayerNorm(name="ln")(x)), None


class Scanned(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            ScannedBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = stack(name="layers")(x, None)
        return x.sum()


def transformer_graph(layers: int, dim: int = 32, heads: int = 4, scoped: bool = False) -> Graph:
    """A plain-JAX unrolled pre-norm transformer (a list of per-layer dicts, no module
    names) with a value_and_grad + SGD step; `scoped` wraps layer i in a
    `jax.named_scope(f"blk{i}")`, which find_stacks does not read (an oracle)."""
    key = jax.random.key(0)

    def layer_params():
        return {
            "ln1": jnp.ones(dim),
            "qkv": jax.random.normal(key, (dim, 3 * dim)) * 0.02,
            "wo": jnp.zeros((dim, dim)),
            "ln2": jnp.ones(dim),
            "w1": jax.random.normal(key, (dim, 4 * dim)) * 0.02,
            "w2": jnp.zeros((4 * dim, dim)),
        }

    params = {
        "embed": jnp.zeros((64, dim)),
        "blocks": [layer_params() for _ in range(layers)],
        "head": jnp.zeros((dim, 64)),
    }

    def norm(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    def loss_fn(params, ids):
        b, s = ids.shape
        x = params["embed"][ids]
        mask = jnp.tril(jnp.ones((s, s), bool))
        for i, p in enumerate(params["blocks"]):
            with jax.named_scope(f"blk{i}") if scoped else contextlib.nullcontext():
                q, k, v = jnp.split(norm(x, p["ln1"]) @ p["qkv"], 3, -1)
                q, k, v = (t.reshape(b, s, heads, -1) for t in (q, k, v))
                att = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
                out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v)
                x = x + out.reshape(b, s, dim) @ p["wo"]
                x = x + jax.nn.gelu(norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]
        logits = x @ params["head"]
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    def step(params, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

    return capture(step, (params, jnp.zeros((2, 8), jnp.int32)))


class EncoderLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(4)(nn.LayerNorm()(x))
        return x + nn.Dense(32)(nn.relu(nn.Dense(64)(nn.LayerNorm()(x))))


class DecoderLayer(nn.Module):
    @nn.compact
    def __call__(self, y, memory):
        y = y + nn.MultiHeadDotProductAttention(4)(nn.LayerNorm()(y))
        y = y + nn.MultiHeadDotProductAttention(4)(nn.LayerNorm()(y), memory)
        return y + nn.Dense(32)(nn.relu(nn.Dense(64)(nn.LayerNorm()(y))))


class EncoderDecoder(nn.Module):
    """Every decoder layer reads the encoder's output: its gradient sums across them."""

    layers: int = 2

    @nn.compact
    def __call__(self, src, tgt):
        embed = nn.Embed(96, 32)
        x = embed(src)
        for i in range(self.layers):
            x = EncoderLayer(name=f"encoder_{i}")(x)
        memory, y = nn.LayerNorm()(x), embed(tgt)
        for i in range(self.layers):
            y = DecoderLayer(name=f"decoder_{i}")(y, memory)
        return embed.attend(nn.LayerNorm()(y))


# ----------------------------------------------------------------------------- checks


def check_stack(graph: Graph, stack: LayerStack, layers: int, template: str, backward: bool):
    """The invariants every stack keeps: count, template, disjoint ordered forward blocks
    with one signature, and backward blocks mirroring them (or none)."""
    assert len(stack.forward) == layers, stack.describe()
    assert stack.template == template
    assert [b.index for b in stack.forward] == list(range(layers))
    ids = [set(b.nodes) for b in stack.forward + stack.backward]
    assert sum(map(len, ids)) == len(set().union(*ids)), "blocks overlap"
    for a, b in zip(stack.forward, stack.forward[1:]):
        assert max(a.nodes) < min(b.nodes), "forward blocks out of program order"
    for blocks in (stack.forward, stack.backward):
        for b in blocks:
            assert list(b.nodes) == sorted(b.nodes)
            parent = template.split("<i>")[0].split("{")[0]  # siblings joined: `{ln_,mlp_}`
            assert b.params and all(parent in graph.input_paths[p] for p in b.params)
            assert not set(b.params) & set(b.state)
        assert len({signature(graph, b) for b in blocks}) <= 1, "blocks differ in structure"
    if backward:
        assert [b.index for b in stack.backward] == list(reversed(range(layers)))
        first_bwd = min(stack.backward[0].nodes)
        assert all(max(b.nodes) < first_bwd for b in stack.forward)
        for a, b in zip(stack.backward, stack.backward[1:]):
            assert max(a.nodes) < min(b.nodes), "backward blocks out of program order"
        for f, b in zip(stack.forward, reversed(stack.backward)):
            assert f.params == b.params
            # a residual, or under remat the layer's input it recomputes from
            assert set(f.outputs + f.inputs) & set(b.inputs), "the backward reads no forward value"
    else:
        assert stack.backward == ()
    span = lambda blocks: (
        f"{min(i for b in blocks for i in b.nodes)}..{max(i for b in blocks for i in b.nodes)}"
    )  # noqa: E731
    want = f"{layers} x {template}, ops {span(stack.forward)}"
    if stack.backward:  # apart: the ops after the stack run between them
        want += f", backward {span(stack.backward)}"
    assert stack.describe() == want


def signature(graph: Graph, block: Block) -> tuple:
    """A block's op multiset with input and output types."""
    return tuple(
        sorted(
            Counter(
                (
                    graph.nodes[i].op,
                    tuple(str(graph.values[v]) for v in graph.nodes[i].inputs),
                    tuple(str(graph.values[v]) for v in graph.nodes[i].outputs),
                )
                for i in block.nodes
            ).items()
        )
    )


def layer_named(graph: Graph, i: int, pattern: str) -> set[int]:
    """Node ids whose name stack names layer `i` (for the linen models)."""
    rx = re.compile(pattern.format(i=i) + r"(/|\)|$)")
    return {n.id for n in graph.nodes if rx.search(n.name_stack)}


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def llama():
    return llama_graphs(3)


def test_llama_train_step(llama):
    train, _ = llama
    (stack,) = find_stacks(train)
    check_stack(train, stack, 3, "params/params/layers_<i>", backward=True)
    for b in stack.forward + stack.backward:
        assert len(b.params) == 9 and len(b.state) == 18  # AdamW's mu and nu mirrors
        assert all("opt_state" in train.input_paths[p] for p in b.state)
    # the blocks agree with the module names: all of layer i's named ops but for dead code
    for blk in stack.forward:
        named = layer_named(train, blk.index, r"jvp\(Llama\)/layers_{i}")
        assert set(blk.nodes) <= named and len(named - set(blk.nodes)) <= 1
    for blk in stack.backward:
        named = layer_named(train, blk.index, r"transpose\(jvp\(Llama\)\)/layers_{i}")
        assert set(blk.nodes) == named
    # the embedding, position ids, mask, final norm and optimizer are in no block
    inside = {i for b in stack.forward + stack.backward for i in b.nodes}
    for n in train.nodes:
        if re.search(r"embed_tokens|/norm|lm_head", n.name_stack) or not n.name_stack:
            assert n.id not in inside, n


def test_the_users_remat_recomputes_inside_each_layers_backward_block():
    """Under the user's `nn.remat` a layer's backward starts by recomputing its forward
    from the layer's input (an `optimization_barrier`, then the first norm), ops that
    read no parameter and no cotangent: they are the layer's, else a pipeline's
    backward loop would not read what its forward loop saved (1F1B gave way to GPipe)."""
    train, _ = llama_graphs(3, remat=True)
    (stack,) = find_stacks(train)
    check_stack(train, stack, 3, "params/params/layers_<i>", backward=True)
    for blk in stack.backward:
        named = layer_named(train, blk.index, r"rematted_computation/layers_{i}")
        live = {i for i in named if any(train.consumers.get(y) for y in train.nodes[i].outputs)}
        assert live and live <= set(blk.nodes), sorted(live - set(blk.nodes))[:5]
        assert any(train.nodes[i].op == "optimization_barrier" for i in blk.nodes)


def test_llama_forward_only(llama):
    _, forward = llama
    (stack,) = find_stacks(forward)
    check_stack(forward, stack, 3, "params/params/layers_<i>", backward=False)
    for blk in stack.forward:
        assert set(blk.nodes) == layer_named(forward, blk.index, r"Llama/layers_{i}")
        assert len(blk.inputs) >= 2  # the activation, the mask, cos and sin
    # layer i's output is layer i + 1's input
    for a, b in zip(stack.forward, stack.forward[1:]):
        assert set(a.outputs) & set(b.inputs)


def test_two_layers():
    train, forward = llama_graphs(2)
    check_stack(train, find_stacks(train)[0], 2, "params/params/layers_<i>", backward=True)
    check_stack(forward, find_stacks(forward)[0], 2, "params/params/layers_<i>", backward=False)


def test_gpt2_with_final_layernorm_and_dropout():
    graph = gpt2_graph(3)
    (stack,) = find_stacks(graph)
    check_stack(graph, stack, 3, "params/h_<i>", backward=True)
    for blk in stack.forward:  # ln_f follows the last block and stays out of it
        ops = {graph.nodes[i].name_stack for i in blk.nodes}
        assert not any("ln_f" in s for s in ops)
        assert layer_named(graph, blk.index, r"jvp\(GPT2\)/h_{i}") >= set(blk.nodes)


def test_nnx_list_of_blocks():
    train, forward = nnx_graphs(3)
    assert "state/blocks/0/linear/kernel/value" in train.input_paths
    (stack,) = find_stacks(train)
    check_stack(train, stack, 3, "state/blocks/<i>", backward=True)
    assert all(len(b.params) == 6 and b.state == () for b in stack.forward)
    (stack,) = find_stacks(forward)
    check_stack(forward, stack, 3, "state/blocks/<i>", backward=False)
    sizes = {len(b.nodes) for b in stack.forward}
    assert len(sizes) == 1 and sizes.pop() >= 10  # norm, two linears, gelu, residual


class InlineMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1], name="fc2")(nn.gelu(nn.Dense(64, name="fc1")(x)))


class Inline(nn.Module):
    """Layers written inline in the loop: siblings `ln_i` and `mlp_i` are layer i."""

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(96, 32, name="embed")(ids)
        for i in range(4):
            x = x + InlineMLP(name=f"mlp_{i}")(nn.LayerNorm(name=f"ln_{i}")(x))
        return nn.Dense(96, name="head")(nn.LayerNorm(name="ln_f")(x))


def test_layers_written_inline_join_their_siblings():
    """`ln_<i>` alone is no layer (the MLP after it would be counted once per two
    norms: 2 layers of 4 were found); the siblings that share an index are one."""
    model = Inline()
    ids = jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.key(0), ids)
    tx = optax.adamw(1e-3)

    def train_step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(lambda p: model.apply(p, ids).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    graph = capture(train_step, (params, tx.init(params), ids))
    (stack,) = find_stacks(graph)
    check_stack(graph, stack, 4, "params/params/{ln_,mlp_}<i>", backward=True)
    for b in stack.forward:
        paths = [graph.input_paths[p] for p in b.params]
        assert sorted({p.split("/")[2] for p in paths}) == [f"ln_{b.index}", f"mlp_{b.index}"]
        assert len(paths) == 6 and len(b.state) == 12  # AdamW's mu and nu mirrors


def sowing_step_graph(model: nn.Module, into_loss: bool) -> Graph:
    """The captured AdamW step of a model whose layers sow `intermediates`: added to
    the loss (an aux loss, `into_loss`) or returned by the step."""
    tx, ids = optax.adamw(1e-3), jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.key(0), ids)["params"]

    def train_step(params, opt_state, ids):
        def loss_fn(p):
            logits, sown = model.apply({"params": p}, ids, mutable=["intermediates"])
            aux = 0.01 * sum(jax.tree.leaves(sown)) if into_loss else 0.0
            return logits.mean() + aux, sown

        (loss, sown), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        out = (optax.apply_updates(params, updates), opt_state, loss)
        return out if into_loss else (*out, sown)

    return capture(train_step, (params, tx.init(params), ids))


class MoE(nn.Module):
    """Top-2 of 4 experts, one-hot dispatch, and a Switch-style load-balancing loss
    sown for the train step to add up over the layers."""

    @nn.compact
    def __call__(self, x):
        probs = jax.nn.softmax(nn.Dense(4, use_bias=False, name="router")(x), -1)
        gate, idx = jax.lax.top_k(probs, 2)
        dispatch = jax.nn.one_hot(idx, 4)
        combine = jnp.einsum("bsk,bske->bse", gate, dispatch)
        w = self.param("experts", nn.initializers.lecun_normal(), (4, x.shape[-1], x.shape[-1]))
        self.sow("intermediates", "aux", 4 * jnp.sum(dispatch.mean((0, 1, 2)) * probs.mean((0, 1))))
        return jnp.einsum("bse,bsd,edf->bsf", combine, x, w)


class MoEBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + MoE()(nn.LayerNorm()(x))


def test_a_load_balancing_loss_summed_over_the_layers_stays_in_each_layer():
    """Each layer's aux loss is a side output: it reaches no later layer, only a sum
    after the stack; it kept the residual stream from being the one live value where
    a layer ends, and the last layer lost its ops (3 layers of 4 were found)."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(64, 32)(ids)
            for i in range(4):
                x = MoEBlock(name=f"block_{i}")(x)
            return nn.Dense(64)(x)

    graph = sowing_step_graph(Model(), into_loss=True)
    (stack,) = find_stacks(graph)
    check_stack(graph, stack, 4, "params/block_<i>", backward=True)
    for blk in stack.forward:  # the layer's aux loss with it
        named = layer_named(graph, blk.index, r"jvp\(Model\)/block_{i}/MoE_0")
        live = {i for i in named if any(graph.consumers.get(y) for y in graph.nodes[i].outputs)}
        assert live <= set(blk.nodes), sorted(live - set(blk.nodes))[:5]


class AuxMoEBlock(nn.Module):
    """`MoE`'s routing and Switch loss, the loss returned with the block's output and
    the experts' outputs weighted after they are computed (as Mixtral-style code
    writes it)."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        probs = jax.nn.softmax(nn.Dense(4, use_bias=False, name="router")(h), -1)
        gate, idx = jax.lax.top_k(probs, 2)
        dispatch = jax.nn.one_hot(idx, 4)
        combine = jnp.einsum("bsk,bske->bse", gate, dispatch)
        aux = 4 * jnp.sum(dispatch.mean((0, 1, 2)) * probs.mean((0, 1)))
        w = self.param("experts", nn.initializers.lecun_normal(), (4, x.shape[-1], x.shape[-1]))
        y = jnp.einsum("bsd,edf->bsef", h, w)
        return x + jnp.einsum("bsef,bse->bsf", y, combine), aux


@pytest.mark.parametrize("summed", ["in the loop", "after it"])
def test_an_aux_loss_each_layer_returns_and_the_loop_sums_stays_in_each_layer(summed):
    """`aux_total = aux_total + aux` in the layer loop (or `sum(auxes)` after it): the
    running sum is in no layer, though its first term (`0.0 + aux_0`) reads one layer
    alone; the routing the loss reads is the layer's own (not its core: no weight is
    read after it); and backward, where the loss's gradient runs after the residual's,
    (the router on the block's input), the layer's end is cut after its last core op.
    Each of these left a layer out (3 of 4), and a pipeline then blamed "an op outside
    the layers"."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x, total, auxes = nn.Embed(64, 32)(ids), 0.0, []
            for i in range(4):
                x, aux = AuxMoEBlock(name=f"block_{i}")(x)
                total, auxes = total + aux, [*auxes, aux]
            return nn.Dense(64)(x), total if summed == "in the loop" else sum(auxes)

    model, tx, ids = Model(), optax.adamw(1e-3), jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.key(0), ids)["params"]

    def train_step(params, opt_state, ids):
        def loss_fn(p):
            logits, aux = model.apply({"params": p}, ids)
            return logits.mean() + 0.01 * aux

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    graph = capture(train_step, (params, tx.init(params), ids))
    (stack,) = find_stacks(graph)
    check_stack(graph, stack, 4, "params/block_<i>", backward=True)
    assert not stack.left_out and "left out" not in stack.describe()


def test_a_layers_end_is_cut_after_its_last_core_op():
    """Plain JAX: each layer's router statistic (its loss, summed in the loop) reads the
    layer's input and nothing but the loss reads it. Backward, that loss's gradient runs
    after the residual's, where the residual's cotangent is the one live value: cut
    there, the last backward layer lost its router's input-gradient sum to the next
    (layer 3 was left out as "its backward ops differ")."""
    n, d, e = 4, 32, 4
    keys = jax.random.split(jax.random.key(0), 2 * n + 1)
    params = {
        "layers": [
            {
                "gate": jax.random.normal(keys[2 * i], (d, e)),
                "w": jax.random.normal(keys[2 * i + 1], (d, d)),
            }
            for i in range(n)
        ],
        "head": jax.random.normal(keys[-1], (d, 8)),
    }

    def loss(params, x, y):
        total = 0.0
        for p in params["layers"]:
            total = total + e * jnp.sum(jax.nn.softmax(x @ p["gate"], -1).mean(0) ** 2)
            x = x + jnp.tanh(x @ p["w"])
        return jnp.mean((x @ params["head"] - y) ** 2) + 0.01 * total

    def step(params, x, y):
        return jax.tree.map(lambda a, g: a - 0.1 * g, params, jax.grad(loss)(params, x, y))

    graph = capture(step, (params, jnp.ones((16, d)), jnp.ones((16, 8))))
    (stack,) = find_stacks(graph)  # layer 0, on the step's argument, padded into it
    assert [b.index for b in stack.backward] == [3, 2, 1, 0], stack.describe()
    assert not stack.left_out and stack.pads, stack.describe()


class Probed(nn.Module):
    """A residual MLP block that sows a per-example statistic of its input or output."""

    of_output: bool

    @nn.compact
    def __call__(self, x):
        if not self.of_output:
            self.sow("intermediates", "sq", jnp.mean(x * x, axis=(1, 2)))
        x = x + nn.Dense(32)(jax.nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))
        if self.of_output:
            self.sow("intermediates", "sq", jnp.mean(x * x, axis=(1, 2)))
        return x


@pytest.mark.parametrize("of_output", [False, True])
def test_a_statistic_each_layer_sows_stays_in_its_layer(of_output):
    """A step that returns what each layer sows: of the layer's output, the statistic
    sits between the layer and the next one's norm, where the data alone would give
    it to the next layer's head; the first layer then had none, matched nothing and
    was left out (3 layers of 4). It belongs to the layer whose module sows it."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(64, 32)(ids)
            for i in range(4):
                x = Probed(of_output, name=f"h_{i}")(x)
            return nn.Dense(64)(x)

    graph = sowing_step_graph(Model(), into_loss=False)
    (stack,) = find_stacks(graph)
    check_stack(graph, stack, 4, "params/h_<i>", backward=True)
    for blk in stack.forward:  # the statistic with the layer that sows it
        sums = [i for i in blk.nodes if graph.nodes[i].op == "reduce_sum"]
        stat = [i for i in sums if graph.nodes[i].name_stack.endswith(f"h_{blk.index}")]
        assert len(stat) == 1, (blk.index, [graph.nodes[i].name_stack for i in sums])


def widening_graph(widths: tuple[int, ...]) -> Graph:
    model = Widening(widths)
    x = jnp.zeros((4, 32))
    params = model.init(jax.random.key(0), x)
    return capture(lambda p, x: jax.grad(lambda p: model.apply(p, x))(p), (params, x))


def test_different_widths_make_no_stack():
    assert find_stacks(widening_graph((32, 64))) == ()
    # 32 -> 32, 32 -> 32 | 32 -> 64 | 64 -> 64, 64 -> 64: two runs, none across widths
    graph = widening_graph((32, 32, 64, 64, 64))
    first, second = find_stacks(graph)
    assert [b.index for b in first.forward] == [0, 1]
    assert [b.index for b in second.forward] == [3, 4]
    assert [b.index for b in second.backward] == [4, 3]


def test_scanned_layers_are_not_unrolled_stacks():
    model = Scanned()
    x = jnp.zeros((4, 32))
    params = model.init(jax.random.key(0), x)
    graph = capture(lambda p, x: jax.value_and_grad(model.apply)(p, x), (params, x))
    assert any(n.op == "scan" for n in graph.nodes)
    assert find_stacks(graph) == ()


def test_plain_jax_blocks_match_named_scopes():
    """Dataflow alone (find_stacks reads no module names) recovers each layer's ops
    exactly, as an unread `jax.named_scope` per layer records them."""
    graph = transformer_graph(4, scoped=True)
    (stack,) = find_stacks(graph)
    check_stack(graph, stack, 4, "params/blocks/<i>", backward=True)
    for blk in stack.forward:  # all but an unused broadcast (dead code) per layer
        named = layer_named(graph, blk.index, r"^jvp\(blk{i}\)")
        assert set(blk.nodes) <= named and len(named - set(blk.nodes)) <= 1
    for blk in stack.backward:
        assert set(blk.nodes) == layer_named(graph, blk.index, r"^transpose\(jvp\(blk{i}\)\)")


def test_encoder_decoder():
    model = EncoderDecoder(2)
    ids = jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.key(0), ids, ids)

    def step(params, ids):
        def loss(p):
            logits = model.apply(p, ids, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

        return jax.grad(loss)(params)

    graph = capture(step, (params, ids))
    encoder, decoder = find_stacks(graph)
    check_stack(graph, encoder, 2, "params/params/encoder_<i>", backward=True)
    check_stack(graph, decoder, 2, "params/params/decoder_<i>", backward=True)


class BiasedLayer(nn.Module):
    """A T5 block: attention logits plus a position bias every layer reads (the first
    layer makes it, with the batch's padding mask added), dropout on the attention
    weights and on both residual branches."""

    first: bool = False

    @nn.compact
    def __call__(self, x, bias, mask):
        drop = nn.Dropout(0.1, deterministic=False)
        if self.first:
            bias = self.param("rel_bias", nn.initializers.normal(0.1), (4, 8, 8))[None] + mask
        b, s, d = x.shape
        h = nn.LayerNorm()(x)
        q, k, v = (nn.Dense(d, use_bias=False, name=n)(h).reshape(b, s, 4, -1) for n in "qkv")
        w = drop(jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias, -1))
        x = x + drop(nn.Dense(d)(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, d)))
        h = nn.Dense(d)(drop(nn.relu(nn.Dense(2 * d)(nn.LayerNorm()(x)))))
        return x + drop(h), bias


class BiasedStack(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x, bias = nn.Embed(96, 32)(ids), None
        mask = jnp.where(ids > 0, 0.0, -1e9)[:, None, None, :]
        for i in range(6):
            x, bias = BiasedLayer(first=i == 0, name=f"block_{i}")(x, bias, mask)
        return nn.Dense(96)(x)


def test_a_shared_bias_and_dropout_keep_every_layer_in_the_stack():
    """T5's relative position bias, made by the first layer and read by all, has its
    gradient summed across the layers; the first backward layer's share waits for the
    next one's, and counted live it pushed that layer's cut past its residual dropout's
    backward: the last two layers differed and were left out (3 of the 6 `block_<i>`,
    as in a T5 with dropout)."""
    model = BiasedStack()
    ids = jnp.arange(16).reshape(2, 8) % 96
    params = model.init(jax.random.key(0), ids)

    def step(params, ids, key):
        def loss(p):
            logits = model.apply(p, ids, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids).mean()

        return jax.grad(loss)(params)

    graph = capture(step, (params, ids, jax.random.key(1)))
    (stack,) = find_stacks(graph)
    assert [b.index for b in stack.forward] == [1, 2, 3, 4, 5], stack.describe()
    assert [b.index for b in stack.backward] == [5, 4, 3, 2, 1], stack.describe()
    assert stack.apart == (0,) and not stack.left_out, stack.describe()
    assert len({signature(graph, b) for b in stack.backward}) == 1  # alike, op for op


def test_pure_and_min_layers(llama):
    train, _ = llama
    nodes, values, consumers = train.nodes, train.values, dict(train.consumers)
    assert find_stacks(train) == find_stacks(train)
    assert train.nodes is nodes and train.values is values and train.consumers == consumers
    assert find_stacks(train, min_layers=4) == ()


def test_48_layers_fast():
    graph = transformer_graph(48)
    start = time.perf_counter()
    stacks = find_stacks(graph)
    elapsed = time.perf_counter() - start
    (stack,) = stacks
    check_stack(graph, stack, 48, "params/blocks/<i>", backward=True)
    assert elapsed < 5.0, f"{elapsed:.2f} s for {len(graph.nodes)} nodes"


class BlocksOnTheArgument(nn.Module):
    """`n` residual blocks, the first applied straight to the step's argument."""

    n: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.n):
            x = x + nn.relu(nn.Dense(32, name=f"blocks_{i}")(x))
        return nn.Dense(1, name="head")(x)


def _blocks_step(n: int, tx=None):
    model, tx = BlocksOnTheArgument(n), tx or optax.sgd(0.1)
    x = jnp.sin(jnp.arange(16 * 32.0).reshape(16, 32) * 0.37)
    params = model.init(jax.random.key(0), x)

    def step(params, opt_state, x):
        g = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = tx.update(g, opt_state)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params), x)


def test_a_first_layer_on_an_argument_of_the_step_is_padded_into_the_stack():
    """Blocks applied straight to an argument of the step: JAX computes no gradient for
    that argument, so the first block's backward lacks the input gradient's ops (its
    `g @ W.T` and the residual's `add_any`). The stack still holds all four layers
    (it was the other three, "layer 0 left out", and `pipeline_stages=2` refused the
    model): the two ops are named as pads, and written in they make the first layer's
    backward op for op the others'; their results are read by nothing."""
    from autopar.ir.graph import check_graph, signature
    from autopar.passes import stack_pad

    step, args = _blocks_step(4)
    graph = capture(step, args)
    (stack,) = find_stacks(graph)
    assert len(stack.forward) == 4 and stack.left_out == () and len(stack.pads) == 2
    assert {graph.nodes[p.like].op for p in stack.pads} == {"dot_general", "add_any"}
    assert "layer 0 reads an argument of the step" in stack.describe()
    g2, s2 = stack_pad.padded(stack, graph)
    check_graph(g2)
    assert len(g2.nodes) == len(graph.nodes) + 2 and s2.pads == ()
    sigs = [[signature(g2, g2.nodes[i]) for i in b.nodes] for b in s2.backward]
    assert all(sg == sigs[0] for sg in sigs)
    new = set(range(len(graph.values), len(g2.values)))  # what the pads make: read by pads
    assert all(set(n.outputs) <= new for n in g2.nodes if new & set(n.inputs))
    assert not new & set(g2.outputs)
    trimmed = stack_pad.trimmed(stack)  # what rolls where four layers do not split into the stages
    assert len(trimmed.forward) == 3 and trimmed.left_out == (0,) and trimmed.pads == ()


def test_two_layers_alike_but_for_the_first_ones_backward_make_a_stack(monkeypatch):
    """Two blocks, the first applied straight to an argument of the step: padded, they
    are a stack, so `pipeline_stages=2` pipelines them and `remat="full"` recomputes
    both (no stack was found: the pipeline refused and remat did nothing). Where the
    pads do not line up, both messages still name the layers and why."""
    import autopar.passes.stack_pad as stack_pad

    step, args = _blocks_step(2)
    (stack,) = find_stacks(capture(step, args))
    assert len(stack.forward) == 2 and stack.pads
    plan = autopar.parallelize(step, mesh={"stage": 2, "data": 4}, pipeline_stages=2).plan(*args)
    assert plan.pipeline["rolled"]["layers"] == 2
    par = autopar.parallelize(step, mesh={"data": 8}, remat="full")
    assert par.plan(*args).remat == "full"
    assert_trees_close(par(*args), jax.jit(step)(*args), what="a remat step")

    monkeypatch.setattr(stack_pad, "align", lambda *a: None)
    assert find_stacks(capture(step, args)) == ()
    why = r"the 2 layers of .*blocks_<i> have the same forward ops, but the backward ops of layer 0"
    why += r".*first layer reads an argument of the step"
    with pytest.raises(autopar.PipelineError, match=why):
        autopar.parallelize(step, mesh={"stage": 2, "data": 4}, pipeline_stages=2).plan(*args)
    with pytest.warns(UserWarning, match="remat") as caught:
        plan = autopar.parallelize(step, mesh={"data": 8}, remat="full").plan(*args)
    assert plan.remat is None
    assert any(re.search(why, str(w.message)) for w in caught), [str(w.message) for w in caught]


def test_layers_alike_but_for_a_backward_not_made_by_an_argument_name_the_first_difference():
    """A ResNet block's two 3x3 convolutions (`conv_<i>`) have the same forward ops and
    different backward ops, but neither reads an argument of the step: the message
    names the first backward op that differs, not the hint about arguments."""
    from benchmarks.user_models_defs import MODELS

    builder, _, (cfg, _) = MODELS["resnet"]
    case = builder(cfg)
    with pytest.raises(autopar.PipelineError) as caught:
        autopar.parallelize(case.step, mesh={"stage": 2, "data": 2}, pipeline_stages=2).plan(
            *case.args(concrete=False)
        )
    text = str(caught.value)
    assert re.search(r"layers of .*conv_<i> have the same forward ops", text), text
    assert re.search(r"\d+ ops against \d+, the first that differs at .*bn_0", text), text
    assert "reads an argument" not in text, text


def test_a_layer_of_the_template_left_out_of_the_stack_is_named():
    """T5's first block computes the relative position bias (a parameter and ops of its
    own): the stack is blocks 1..3, and its description names block 0 as left out
    (it was silent: "3 x params/encoder_block_<i>" of a model with 4)."""

    class Block(nn.Module):
        first: bool = False

        @nn.compact
        def __call__(self, x):
            if self.first:
                x = x + self.param("bias", nn.initializers.zeros, (x.shape[-1],))
            return x + nn.Dense(x.shape[-1])(jnp.tanh(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(4):
                x = Block(first=i == 0, name=f"block_{i}")(x)
            return x

    model, x = Model(), jnp.ones((4, 16))
    params = model.init(jax.random.key(0), x)
    graph = capture(
        lambda p, x: jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2))(p), (params, x)
    )
    (stack,) = find_stacks(graph)
    assert [b.index for b in stack.forward] == [1, 2, 3] and stack.apart == (0,)
    assert "(layer 0 not in it: its parameters or ops differ" in stack.describe()
