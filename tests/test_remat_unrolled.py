"""Rematerialization of layers unrolled in Python (`autopar.passes.remat_unrolled`): a
linen GPT-2-style decoder whose blocks are a Python loop, as public Flax code writes it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from dataclasses import replace

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import REPO_ROOT, assert_trees_close, run_steps

import autopar
from autopar.ir.capture import capture
from autopar.ir.graph import check_graph
from autopar.passes.remat import rematerialize
from autopar.passes.stacks import find_stacks

STEM = "embed"
VOCAB = 256


class Block(nn.Module):
    d: int
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        B, S, _ = x.shape
        h = nn.LayerNorm()(x)
        q, k, v = jnp.split(nn.Dense(3 * self.d)(h), 3, -1)  # fused qkv, with bias
        split = lambda t: t.reshape(B, S, self.heads, -1).transpose(0, 2, 1, 3)
        q, k, v = split(q), split(k), split(v)
        mask = jnp.tril(jnp.ones((S, S), bool))
        scores = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(q.shape[-1]), -1e9)
        a = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(B, S, -1)
        x = x + nn.Dense(self.d)(a)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.d)(jax.nn.gelu(nn.Dense(4 * self.d)(h)))


class Decoder(nn.Module):
    d: int
    layers: int

    @nn.compact
    def __call__(self, x):
        if STEM == "embed":  # token ids in, as GPT-2: gradients flow below the stack
            x = nn.Embed(VOCAB, self.d, name="wte")(x)
        elif STEM:
            x = nn.Dense(self.d, name="wte")(x)
        for i in range(self.layers):
            x = Block(self.d, name=f"h_{i}")(x)
        return nn.LayerNorm(name="ln_f")(x)


def make(layers: int = 4, d: int = 64, batch: int = 8, seq: int = 64, eps: float = 1e-8):
    model = Decoder(d, layers)
    if STEM == "embed":
        x = jnp.arange(batch * seq).reshape(batch, seq) % VOCAB
    else:
        x = jnp.sin(jnp.arange(batch * seq * d, dtype=jnp.float32).reshape(batch, seq, d) * 0.01)
    params = model.init(jax.random.key(0), x)
    opt = optax.adamw(1e-3, eps=eps)

    def step(state, x):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, opt.init(params)), x


@pytest.mark.parametrize("policy", ["dots", "selective", "full"])
def test_same_numbers_and_fewer_residuals(policy):
    step, state, x = make()
    graph = capture(step, (state, x))
    out, report = rematerialize(graph, policy)
    check_graph(out)
    assert report.applied and len(report.layers) == 4 and "h_<i>" in report.stack
    assert all(r.recomputed > 0 for r in report.layers)
    # each tensor the copies read behind a barrier of its own (a mesh axis splits one
    # tensor of a barrier), but the cotangent they wait for, beside the activation
    bars = [n for n in out.nodes if n.op == "optimization_barrier"]
    assert sum(len(n.inputs) > 1 for n in bars) == len(report.layers) < len(bars)
    assert all(len({out.values[v].shape for v in n.inputs}) == 1 for n in bars)
    assert any("layer stack" in line for line in report.notes())
    flat = jax.tree.leaves((state, x))
    from autopar.ir.eval import retrace

    want = jax.jit(retrace(graph))(*flat)
    got = jax.jit(retrace(out))(*flat)
    assert_trees_close(list(got), list(want), what=policy)
    if policy == "full":  # only what enters a layer stays: nothing made inside it
        assert all(r.stored == 0 for r in report.layers)


def test_stack_found_before_remat():
    step, state, x = make(layers=3)
    stacks = find_stacks(capture(step, (state, x)))
    assert stacks and len(stacks[0].forward) == 3 and len(stacks[0].backward) == 3


MEMORY_SCRIPT = """
import flax.linen as nn
import jax, sys
sys.path.insert(0, "tests")
import test_remat_unrolled as T
from autopar.ir.capture import capture
from autopar.ir.eval import retrace
from autopar.passes.remat import rematerialize
for stem, wait in ((False, True), ("embed", True), ("embed", False)):
    T.STEM = stem
    step, state, x = T.make(layers=8, d=128, batch=8, seq=256)
    graph = capture(step, (state, x))
    flat = jax.tree.leaves((state, x))
    for policy in ("none", "dots", "full"):
        g, _ = rematerialize(graph, policy, wait_for_gradients=wait)
        temp = jax.jit(retrace(g)).lower(*flat).compile().memory_analysis().temp_size_in_bytes
        print(bool(stem), wait, policy, temp)
    if stem and not wait:  # the reference: jax.checkpoint on each layer, plain jax.jit
        plain, T.Block = T.Block, nn.remat(T.Block)
        step, state, x = T.make(layers=8, d=128, batch=8, seq=256)
        temp = jax.jit(step).lower(state, x).compile().memory_analysis().temp_size_in_bytes
        T.Block = plain
        print(True, False, "checkpoint", temp)
"""


def test_compiled_memory_drops_with_a_memory_aware_schedule():
    """XLA:CPU's default scheduler orders for concurrency and ignores memory, so on it
    neither `jax.checkpoint` nor this pass lowers an unrolled step's temporaries; with
    its memory scheduler (a DFS post-order) they drop. 8 layers, d=128, seq 256, full
    remat keeps > 3x less, fed by the input (292 -> 50 MiB; its first layer, on the
    argument, padded into the stack) and with an embedding below the stack (295 -> 52
    MiB). The latter needs each recomputation to wait, by data, for the weight
    gradients of the layer above (`wait_for_gradients`): XLA:CPU drops the barriers
    before it schedules, and its DFS, starting from the embedding's gradient (which the
    cotangent chain alone feeds), runs that chain through all layers, recomputation
    included, before any weight gradient, which then hold every layer's recomputed
    residuals: without the wait only 1.4x (213 MiB), what `jax.checkpoint` on each layer
    keeps too (the module docstring has the story)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEMORY_SCRIPT)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    temp = {
        (a == "True", b == "True", c): int(d)
        for a, b, c, d in (ln.split() for ln in r.stdout.split("\n") if ln)
    }
    for stem in (False, True):
        assert temp[stem, True, "full"] * 3 < temp[stem, True, "none"], temp
        assert temp[stem, True, "full"] < temp[stem, True, "dots"] < temp[stem, True, "none"]
    # without the wait, the embedding's chain runs first: no better than jax.checkpoint
    assert temp[True, False, "full"] > 2 * temp[True, True, "full"], temp
    assert temp[True, False, "full"] <= 1.05 * temp[True, False, "checkpoint"], temp


def test_parallelize_remat_on_unrolled_layers_trains_like_jit():
    # eps 1e-4: the key bias's gradient is exactly zero (`test_users_nn_remat_...`)
    step, state, x = make(layers=2, d=32, batch=8, seq=16, eps=1e-4)
    par = autopar.parallelize(step, mesh={"data": 2, "model": 2}, cluster="cpu", remat="full")
    plan = par.plan(state, x)
    assert plan.remat == "full"
    assert any("layer stack" in w for w in plan.warnings), plan.warnings
    # XLA:CPU drops the barriers: each recomputation waits, by data, for the gradients
    assert any("waits for the weight gradients" in w for w in plan.warnings), plan.warnings
    batch = lambda i: (x + i) % VOCAB
    losses, got = run_steps(par, state, batch, 2)
    ref, want = run_steps(jax.jit(step), state, batch, 2)
    assert_trees_close(losses, ref, what="losses")
    assert_trees_close(got, want, what="params and AdamW state")


def test_recomputation_waits_for_gradients_only_where_barriers_are_dropped():
    """Barriers order the recomputation where the compiler keeps them through scheduling
    (a plan for GPUs, made offline on an abstract mesh); XLA:CPU drops them."""
    from jax.sharding import AbstractMesh

    from autopar.meshes import drops_barriers, make_mesh

    assert drops_barriers(make_mesh({"data": 2}))
    assert not drops_barriers(AbstractMesh((64,), ("data",)))
    step, state, x = make(layers=3, d=32, batch=8, seq=16)
    graph = capture(step, (state, x))
    plain, _ = rematerialize(graph, "full")
    waits, report = rematerialize(graph, "full", wait_for_gradients=True)
    assert [r.waits for r in report.layers] == [True, True, False]  # the last runs first
    extra = waits.op_counts()
    for op, n in plain.op_counts().items():
        extra[op] -= n
    # per waiting layer: a max of each of the layer above's 12 weight and bias gradients
    assert extra["reduce_max"] == 2 * 12, extra
    assert "waits for the weight gradients" in report.notes()[0]


def test_remat_with_nothing_to_rematerialize_warns_and_records_none():
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return loss, w - 0.1 * g

    w, x = jnp.ones((32, 32)) * 0.1, jnp.ones((16, 32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.parallelize(step, mesh={"data": 2}, cluster="cpu", remat="full").plan(w, x)
    assert plan.remat is None
    assert any("nothing to rematerialize" in str(c.message) for c in caught), caught


def test_remat_on_a_loop_the_user_checkpointed_says_why_nothing_changed():
    """A `scan` over `jax.checkpoint`ed layers (`nn.scan(nn.remat(Block))`) already
    recomputes all it can: the warning names the loop it found, where it said that no
    forward/backward scan pair was found."""

    def step(ws, x):
        def loss(ws):
            layer = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))
            h, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)
            return jnp.mean(h**2)

        loss, g = jax.value_and_grad(loss)(ws)
        return loss, ws - 0.1 * g

    ws, x = jnp.ones((3, 32, 32)) * 0.1, jnp.ones((16, 32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.parallelize(step, mesh={"data": 2}, cluster="cpu", remat="full").plan(ws, x)
    assert plan.remat is None
    (said,) = [str(c.message) for c in caught if "nothing to rematerialize" in str(c.message)]
    assert "the scan at" in said and "keeps no residual" in said, said
    assert not any("recomputes 0 of" in w for w in plan.warnings), plan.warnings


def _encoder_decoder_step():
    from test_stacks import EncoderDecoder

    # Adam's eps well above 1e-8: an attention key bias's gradient is zero up to rounding
    model, tx = EncoderDecoder(2), optax.adamw(1e-2, eps=1e-4)
    src = (jnp.arange(64).reshape(8, 8) * 5) % 96
    params = model.init(jax.random.key(0), src, src)

    def step(state, ids):
        params, opt_state = state
        logits_of = lambda p: model.apply(p, ids, ids)  # noqa: E731
        loss, g = jax.value_and_grad(
            lambda p: optax.softmax_cross_entropy_with_integer_labels(logits_of(p), ids).mean()
        )(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, tx.init(params)), src


def test_remat_covers_every_stack_of_an_encoder_decoder():
    """Both stacks are rematerialized (the decoder's was left alone, silently)."""
    step, state, src = _encoder_decoder_step()
    graph = capture(step, (state, src))
    out, report = rematerialize(graph, "full")
    assert len(report.others) == 1 and "decoder_<i>" in report.others[0][0], report.notes()
    assert "encoder_<i>" in report.stack and len(report.layers) == 2
    check_graph(out)
    first = report.others[0][1]
    assert all(r.recomputed for r in (*report.layers, *first))
    # with a count of first layers (`remat="auto"`) the first stack only, said
    _, part = rematerialize(graph, "full", layers=1)
    assert not part.others and len(part.skipped) == 1 and "decoder_<i>" in part.skipped[0]
    assert any("is not rematerialized" in n for n in part.notes())


@pytest.mark.slow  # 21 s: the two stacks' remat, trained against jax.jit
def test_an_encoder_decoder_rematerialized_trains_like_jax_jit():
    step, state, src = _encoder_decoder_step()
    par = autopar.parallelize(step, mesh={"data": 2, "model": 2}, cluster="cpu", remat="full")
    plan = par.plan(state, src)
    assert len([w for w in plan.warnings if w.startswith("remat (full): layer stack")]) == 2
    batch = lambda i: (src + i) % 96  # noqa: E731
    losses, got = run_steps(par, state, batch, 2)
    ref_losses, ref = run_steps(jax.jit(step), state, batch, 2)
    assert_trees_close(losses, ref_losses, what="losses")
    assert_trees_close(got, ref, what="params and optimizer state")


def test_first_layers_only_keep_the_numbers():
    step, state, x = make()
    graph = capture(step, (state, x))
    out, report = rematerialize(graph, "full", layers=2)
    check_graph(out)
    assert [r.index for r in report.layers] == [0, 1] and report.stack_layers == 4
    assert any("layers 0-1 of 4" in line for line in report.notes()), report.notes()
    _, every = rematerialize(graph, "full")
    assert sum(r.recomputed_bytes for r in report.layers) < sum(
        r.recomputed_bytes for r in every.layers
    )
    from autopar.ir.eval import retrace

    flat = jax.tree.leaves((state, x))
    assert_trees_close(
        list(jax.jit(retrace(out))(*flat)), list(jax.jit(retrace(graph))(*flat)), what="2 of 4"
    )


def test_auto_remat_on_a_pipelined_stack_does_not_try_first_layers_only(monkeypatch):
    """A pipeline recomputes all its layers or none (its stages run one loop body), and
    recomputing fewer layers holds more memory than all of them: where a policy fits
    only pipelined, `remat="auto"` does not bisect on how many first layers to
    recompute (each probe was a whole search, ~50 s on GPT-3 175B), and the plan
    recomputes every layer."""
    from autopar.compile import driver

    monkeypatch.setattr(driver, "COMPILE_CHECK_FRACTION", 10.0)
    step, state, x = make(layers=8, d=32, batch=8, seq=32)
    kw = {"mesh": {"stage": 2, "data": 2}, "cluster": "cpu", "engine": "recursive",
          "pipeline_stages": 2, "microbatches": 2}  # fmt: skip
    peak = {r: autopar.parallelize(step, remat=r, **kw).plan(state, x) for r in ("none", "full")}
    hi, lo = (peak[r].cost.peak_memory_bytes for r in ("none", "full"))
    assert lo < hi
    plan = autopar.parallelize(step, remat="auto", memory_budget=(lo + hi) / 2, **kw).plan(state, x)
    tried = next(w for w in plan.warnings if w.startswith("remat='auto' tried"))
    assert "remat=none: " in tried and "on the first" not in tried, tried
    assert plan.remat is not None and plan.remat_layers is None and plan.pipeline


def test_auto_remat_recomputes_only_the_layers_the_budget_needs(monkeypatch):
    """Between the peak with no remat and with every layer recomputed, `remat="auto"`
    recomputes the stack's first layers only, as few as fit: faster than every layer,
    within the budget, recorded in the plan and its file, training like `jax.jit`."""
    from autopar.compile import driver

    # the predicted peaks are the point here; XLA:CPU's compiled ones are another test's
    monkeypatch.setattr(driver, "COMPILE_CHECK_FRACTION", 10.0)
    step, state, x = make(layers=8, d=32, batch=8, seq=32)
    mesh, kw = {"data": 2}, {"cluster": "cpu", "engine": "recursive"}  # remat is the point
    peak = {
        r: autopar.parallelize(step, mesh=mesh, remat=r, **kw).plan(state, x)
        for r in ("none", "full")
    }
    hi, lo = (peak[r].cost.peak_memory_bytes for r in ("none", "full"))
    assert lo < hi
    budget = lo + 0.5 * (hi - lo)
    par = autopar.parallelize(step, mesh=mesh, remat="auto", memory_budget=budget, **kw)
    plan = par.plan(state, x)
    assert plan.remat is not None and plan.remat_layers is not None, plan.warnings
    assert 0 < plan.remat_layers < 8
    assert plan.cost.peak_memory_bytes <= budget
    assert any(f"layers 0-{plan.remat_layers - 1} of 8" in w for w in plan.warnings)
    full = autopar.parallelize(step, mesh=mesh, remat=plan.remat, **kw).plan(state, x)
    assert plan.cost.step_s < full.cost.step_s
    again = autopar.Plan.from_json(plan.to_json())
    assert again.remat_layers == plan.remat_layers
    batch = lambda i: (x + i) % VOCAB
    losses, _ = run_steps(par, state, batch, 2)
    ref, _ = run_steps(jax.jit(step), state, batch, 2)
    assert_trees_close(losses, ref, what="losses")


def test_users_nn_remat_is_searched_sharded_and_kept(monkeypatch):
    """A model whose blocks are `nn.remat` (`jax.checkpoint`): the backward of each block
    (JAX's `remat2` op) is inlined, its recomputation behind an optimization barrier as
    JAX lowers it, so the search shards it like any op (it was one opaque op, run
    replicated) and the compiled program still recomputes (as many dots as jax.jit's)."""
    import re

    monkeypatch.setattr(sys.modules[__name__], "Block", nn.remat(Block))
    # eps 1e-4: the key bias's gradient is exactly zero (softmax ignores a per-query
    # shift), and Adam at eps 1e-8 turns its rounding noise into full steps
    step, state, x = make(layers=2, d=32, batch=8, seq=16, eps=1e-4)
    graph = capture(step, (state, x))
    assert not [n for n in graph.nodes if n.op == "remat2"]
    bars = [n for n in graph.nodes if n.op == "optimization_barrier"]
    # a barrier per input the recomputation reads: a mesh axis can split one tensor of
    # a barrier, so one over the whole block would leave all its weights but two whole
    assert all(len(n.inputs) == 1 for n in bars)
    assert len(bars) > 2 * 4  # the block's 4+ weights and its activation, per block
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*no sharding rule")
        par = autopar.parallelize(step, mesh={"data": 2, "model": 2}, cluster="cpu")
        plan = par.plan(state, x)
    assert not [o for o in plan.ops if "no rule" in o.strategy]
    barriers = [o for o in plan.ops if o.op == "optimization_barrier"]
    assert any(any(s.used_axes for s in o.in_specs) for o in barriers), barriers
    dots = lambda f: len(re.findall(r" dot\(", f.lower(state, x).compile().as_text()))
    assert dots(par) == dots(jax.jit(step))
    batch = lambda i: (x + i) % VOCAB
    losses, got = run_steps(par, state, batch, 2)
    ref, want = run_steps(jax.jit(step), state, batch, 2)
    assert_trees_close(losses, ref, what="losses")
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5, what="state")


def test_full_remat_of_unrolled_layers_plans_as_the_scanned_stack():
    """GPT-3-width layers (2 of them, bf16, abstract arguments) on data 128 x model 8,
    remat="full": unrolled in Python they plan as fast as under `nn.scan`. With the
    recomputation reading a layer's weights through one barrier, a mesh axis could
    split only one of them and the plan gathered the rest (1.70x the scanned price)."""
    from autopar.examples.models import gpt

    prices = {}
    for scan in (True, False):
        cfg = gpt.GPTConfig(
            vocab=51200, seq=2048, hidden=12288, layers=2, heads=96, dtype=jnp.bfloat16,
            batch_size=1536, scan_layers=scan,
        )  # fmt: skip
        mesh = jax.sharding.AbstractMesh((128, 8), ("data", "model"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # not compile-checked: an abstract mesh
            par = autopar.parallelize(
                gpt.make_train_step(cfg).step, mesh=mesh, cluster="a100-80g", remat="full"
            )
            plan = par.plan(*gpt.abstract_args(cfg))
        assert plan.remat == "full"
        prices[scan] = plan.cost.step_s
    assert prices[False] <= 1.02 * prices[True], prices


def test_auto_remat_searches_again_every_one_loop_plan_within_the_margin():
    """`remat="auto"` on a pipelined unrolled stack: each policy's best is priced on the
    layers rolled into one loop (a `Proxy`) and made by a search as it runs; every one
    priced within `ONE_LOOP_MARGIN` of the fastest plan made is searched again (the
    one-loop price can be that far off), the fastest made wins, the rest are not searched,
    and one whose search finds no plan that fits gives way to the next."""
    from types import SimpleNamespace

    from autopar.compile.calls import Proxy
    from autopar.compile.pipelines import Infeasible
    from autopar.compile.step import ONE_LOOP_MARGIN, fastest_made
    from autopar.errors import MemoryBudgetError

    searched = []

    def proxy(name: str, priced: float, made: float | None) -> Proxy:
        def realize():
            searched.append(name)
            if made is None:
                return Infeasible(MemoryBudgetError(f"{name}: over the budget"))
            return SimpleNamespace(step_s=made, name=name)

        return Proxy(priced, True, name, realize)

    near = 1 + ONE_LOOP_MARGIN / 2
    found = [
        proxy("dots", 1.0, 1.004),
        proxy("selective", near, 0.99),  # priced slower, faster as it runs
        proxy("full", 1.0 * (1 + 3 * ONE_LOOP_MARGIN), 0.5),  # past the margin
    ]
    tried: list[str] = []
    assert fastest_made(found, tried).name == "selective"
    assert searched == ["dots", "selective"]
    assert tried == ["remat=dots searched again: 1004 ms", "remat=selective searched again: 990 ms"]
    searched.clear()
    assert fastest_made([proxy("dots", 1.0, None), proxy("full", 2.0, 2.1)], []).name == "full"
    assert searched == ["dots", "full"]


class DropoutBlock(nn.Module):  # BERT-style: dropout on the attention probabilities
    d: int

    @nn.compact
    def __call__(self, x):
        q, k, v = jnp.split(nn.Dense(3 * self.d)(x), 3, -1)
        p = jax.nn.softmax(q @ k.transpose(0, 2, 1) / jnp.sqrt(self.d), -1)
        p = nn.Dropout(0.1, deterministic=False)(p)
        return nn.LayerNorm()(x + nn.Dense(self.d)(p @ v))


def test_a_dropout_mask_is_drawn_again_only_when_its_layer_is_reached():
    """The recomputation of a dropout mask reads the key, not the activation, so on
    XLA:CPU (barriers dropped) adding the wait to the activation alone let every layer's
    mask be drawn at once: a BERT-style encoder with attention dropout (seq 256) kept
    2.3x less with full remat, against 4.6x without dropout. Every copied op that reads
    no activation now waits through its smallest numeric operand (the key's fold-in
    data): 5.2x. Checked here by dataflow: each layer's recomputed `random_bits` but
    the first-run one's depends on the weight gradients' max."""

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(VOCAB, 32)(ids)
            for i in range(3):
                x = DropoutBlock(32, name=f"layer_{i}")(x)
            return x

    model, ids = Encoder(), jnp.arange(4 * 16).reshape(4, 16) % VOCAB
    params = model.init(jax.random.key(0), ids)

    def step(params, ids, key):
        def loss(p):
            return jnp.mean(model.apply(p, ids, rngs={"dropout": key}) ** 2)

        return jax.grad(loss)(params)

    graph = capture(step, (params, ids, jax.random.key(1)))
    g, report = rematerialize(graph, "full", wait_for_gradients=True)
    assert [r.waits for r in report.layers] == [True, True, False]
    above: dict[int, bool] = {}  # node id -> whether a reduce_max is upstream
    for n in g.nodes:
        ups = [g.producer[x] for x in n.inputs if x in g.producer]
        above[n.id] = any(above[u] or g.nodes[u].op == "reduce_max" for u in ups)
    draws = [n.id for n in g.nodes if n.op == "random_bits"]
    assert len(draws) == 3 + 3  # each layer's, and each layer's recomputation
    assert sum(above[i] for i in draws) == 2, [above[i] for i in draws]


def test_the_note_counts_what_dots_keeps_for_its_recomputation():
    """`"dots"` keeps the contraction outputs its recomputation reads: the note used to
    count only the residuals the backward reads (`keeps 0`, and the bytes of `"full"`)."""
    step, state, x = make(layers=2, d=32, batch=4, seq=16)
    graph = capture(step, (state, x))
    layers = {p: rematerialize(graph, p)[1].layers for p in ("dots", "selective", "full")}
    kept = {p: sum(r.recomputed_bytes for r in ls) for p, ls in layers.items()}
    assert kept["dots"] < kept["selective"] < kept["full"], kept
    assert layers["dots"][0].stored > layers["selective"][0].stored > layers["full"][0].stored == 0


def test_a_remat_note_on_a_stack_of_units_counts_units():
    """A stack whose layers are units of 2 (dense and MoE alternating) is described by
    its units: "4 units of 2 layers", "a unit", not "4 layers" of a model of 8."""
    from autopar.passes.remat_report import RematReport
    from autopar.passes.remat_unrolled import LayerRemat

    layers = tuple(LayerRemat(i, 6, 2, 1 << 20, 1e6) for i in range(4))
    both = RematReport("full", (), "4 units of 2 layers x params/layers_<i>", layers, 4, period=2)
    (note,) = both.notes()
    assert "the backward pass of 4 units of 2 layers recomputes 6 residuals a unit" in note, note
    first = replace(both, layers=layers[:2])
    assert "of units 0-1 of 4 (2 layers each) recomputes" in first.notes()[0]
    plain = replace(both, period=1, stack="4 x params/h_<i>")
    assert "of 4 layers recomputes 6 residuals a layer" in plain.notes()[0]
