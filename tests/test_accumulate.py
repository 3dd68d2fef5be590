"""Gradient accumulation: the per-micro-batch part of a step in a loop, the optimizer once."""

from __future__ import annotations

import functools
import warnings

import jax
import pytest
from helpers import assert_trees_close, replay_from_file, run_steps

import autopar
from autopar.api import compiled_memory
from autopar.errors import MicrobatchError
from autopar.examples.models import gpt

MESH = {"data": 2, "model": 4}
CLUSTER = "cpu"
CFG = gpt.GPTConfig(hidden=64, heads=4, seq=32, vocab=256, layers=2, batch_size=16)


@functools.cache
def _accumulating(m: int = 4):
    ts = gpt.make_train_step(CFG)
    return ts, autopar.parallelize(ts.step, mesh=MESH, cluster=CLUSTER, grad_accumulation=m)


def _trains_like_jax_jit(ts, step, state, n: int) -> None:
    """`n` steps' losses, and one step's optimizer state and parameters, as `jax.jit`'s."""
    losses, _ = run_steps(step, state, ts.batch, n)
    ref_losses, ref_states = run_steps(jax.jit(ts.step), state, ts.batch, n, keep_states=True)
    for i in range(n):
        assert_trees_close(losses[i], ref_losses[i], what=f"loss at step {i}")
    one, _ = step(state, ts.batch(0))
    # moments are scaled gradients (tight); Adam turns noise-level gradients into
    # full-size steps, so parameters compare at the step size
    assert_trees_close(one["opt_state"], ref_states[0]["opt_state"], what="optimizer state")
    assert_trees_close(one["params"], ref_states[0]["params"], atol=2e-3, what="params")


def test_accumulated_training_matches_single_device():
    ts, step = _accumulating()
    state = jax.jit(ts.init)(0)
    _trains_like_jax_jit(ts, step, state, 3)

    plan = step.plan(state, ts.batch(0))
    assert plan.grad_accumulation == 4
    assert "gradient accumulation: 4 micro-batches" in plan.summary()
    (loop,) = [o for o in plan.ops if o.op == "scan"]
    assert loop.key.startswith("grad_accumulation/")
    # accumulated gradients stay Partial sums across micro-batches
    assert any(s.partial for s in loop.in_specs), loop.in_specs


def test_most_gradients_stay_partial_through_the_loop():
    """Accumulated gradients may stay Partial sums through the loop, to be summed once
    after it; the search picks per gradient (it may also reduce-scatter one every
    micro-batch, ZeRO-2 style, where it prices that cheaper: the MLP weights here)."""
    ts, step = _accumulating()
    plan = step.plan(*gpt.abstract_args(CFG))
    (loop,) = [o for o in plan.ops if o.op == "scan"]
    grads = [o for o in loop.out_specs if o.partial]
    assert [s for s in loop.in_specs if s.partial] == grads  # carried as they came in
    n_params = len(jax.tree_util.tree_leaves(gpt.abstract_args(CFG)[0]["params"]))
    assert len(grads) > n_params // 2, (len(grads), n_params)


def test_accumulation_cuts_compiled_memory():
    cfg = gpt.GPTConfig(hidden=128, heads=4, seq=128, vocab=512, layers=2, batch_size=64)
    ts = gpt.make_train_step(cfg)
    args = gpt.abstract_args(cfg)
    mem = {}
    for m in (None, 8):
        step = autopar.parallelize(ts.step, mesh=MESH, cluster=CLUSTER, grad_accumulation=m)
        mem[m] = compiled_memory(step.lower(*args).compile())
        plan = step.plan(*args)
        if m:
            assert plan.cost.peak_memory_bytes < mem[m] * 2  # the model sees the saving too
    assert mem[8] < 0.5 * mem[None], mem


def test_plan_file_round_trips_and_replays(tmp_path):
    ts, step = _accumulating()
    args = (jax.jit(ts.init)(0), ts.batch(0))
    replayed = replay_from_file(step, ts.step, args, tmp_path, mesh=MESH, cluster=CLUSTER)
    assert replayed.grad_accumulation == 4


def test_bad_requests_say_what_to_do():
    ts = gpt.make_train_step(CFG)
    args = gpt.abstract_args(CFG)
    with pytest.raises(MicrobatchError, match="divisible by 3"):
        autopar.parallelize(ts.step, mesh=MESH, cluster=CLUSTER, grad_accumulation=3).plan(*args)
    with pytest.raises(MicrobatchError, match="do not combine"):
        autopar.parallelize(ts.step, mesh=MESH, grad_accumulation=2, pipeline_stages=2)


def _mlp_step():
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.relu(nn.Dense(128)(x))
            return nn.Dense(8)(x)

    model, tx = MLP(), optax.adamw(1e-3)

    def step(params, opt, batch):
        x, y = batch
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
            model.apply(p, x), y
        ).mean()
        g = jax.grad(loss)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt

    x, y = jnp.ones((64, 128)), jnp.zeros((64,), jnp.int32)
    params = model.init(jax.random.key(0), x)
    return step, params, tx.init(params), (x, y)


def test_accumulated_ops_keep_the_users_lines():
    """The rewritten step is traced through autopar's evaluator: every op named
    autopar's line (`mul at eval.py:40`). Each op bound again keeps the user's line (in
    the loop's body too), so budget errors, `inspect` and `explain` name the user's
    code; a loop's results in a budget error are named by the body op that makes them,
    not by the loop."""
    step, params, opt, batch = _mlp_step()
    par = autopar.parallelize(step, mesh=MESH, cluster=CLUSTER, grad_accumulation=4)
    plan = par.plan(params, opt, batch)
    (loop,) = [o for o in plan.ops if o.body is not None]
    ops = [o for o in plan.ops if o is not loop] + list(loop.body.ops)
    here = __file__.rsplit("/", 1)[-1]
    mine = [o for o in ops if o.source.startswith(here)]
    assert len(mine) > 0.8 * len(ops), sorted({o.source for o in ops})
    with pytest.raises(autopar.MemoryBudgetError) as e:
        autopar.parallelize(
            step, mesh=MESH, cluster=CLUSTER, grad_accumulation=4, memory_budget=1e5
        ).plan(params, opt, batch)
    inter = str(e.value).split("Largest intermediates per device:")[1].split("\n")[0]
    assert here in inter and " at eval.py" not in inter and " at accumulate.py" not in inter, inter


def test_a_batch_in_several_arguments_is_cut_together():
    """`step(params, opt, x, y)`, the README's NNX signature: the arguments right before
    the last that are as long along their leading dim are the batch too (only `y` was
    cut, and the micro-batch trace failed on `x`); trained as `jax.jit` trains it. An
    array of the batch's length apart from it is named, with how to pass it."""
    step, params, opt, (x, y) = _mlp_step()

    def apart(params, opt, x, y):
        return step(params, opt, (x, y))

    par = autopar.parallelize(apart, mesh=MESH, cluster=CLUSTER, grad_accumulation=4)
    ref, a, b = jax.jit(apart), (params, opt), (params, opt)
    for i in range(2):
        a = ref(*a, x + i, (y + i) % 8)
        b = par(*b, x + i, (y + i) % 8)
    assert_trees_close(b, a, what="params and optimizer state after 2 steps")

    def first(x, params, opt, y):
        return step(params, opt, (x, y))

    par = autopar.parallelize(first, mesh=MESH, cluster=CLUSTER, grad_accumulation=4)
    with pytest.raises(MicrobatchError, match=r"x \[64, 128\] before it .* \(x, y\)"):
        par.plan(x, params, opt, y)


@pytest.mark.parametrize("key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_the_batch_is_the_last_argument_but_prng_keys(key):
    """`transformers`' Flax scripts call `train_step(state, batch, dropout_rng)`: the
    key after the batch is not cut (cutting it raised "invalid PRNG key data"), the batch
    before it is, and the step trains as under `jax.jit`."""
    import jax.numpy as jnp

    step, params, opt, _ = _mlp_step()
    x = jnp.sin(jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128) / 50)
    y = jnp.arange(64) % 8

    def rng_last(params, opt, batch, rng):
        noisy = (batch[0] + 0.0 * jax.random.normal(rng, batch[0].shape[1:]), batch[1])
        return step(params, opt, noisy)

    par = autopar.parallelize(rng_last, mesh=MESH, cluster=CLUSTER, grad_accumulation=4)
    got = par(params, opt, (x, y), key(0))
    want = jax.jit(rng_last)(params, opt, (x, y), key(0))
    assert_trees_close(got, want, atol=2e-3, what="params and optimizer state")
    assert par.plan(params, opt, (x, y), key(0)).grad_accumulation == 4


def test_the_predicted_peak_holds_a_micro_batchs_pass():
    """The loop's body (a micro-batch's forward and backward pass) is held while the
    loop runs: the predicted peak is near what XLA compiles (it was 0.57x of it when
    only the loop's inputs and results were counted)."""
    cfg = gpt.GPTConfig(hidden=256, heads=4, seq=64, vocab=2048, layers=2, batch_size=32)
    ts = gpt.make_train_step(cfg)
    args = gpt.abstract_args(cfg)
    step = autopar.parallelize(ts.step, mesh={"data": 4}, cluster=CLUSTER, grad_accumulation=4)
    plan = step.plan(*args)
    compiled = compiled_memory(step.lower(*args).compile())
    assert 0.75 * compiled < plan.cost.peak_memory_bytes < 1.5 * compiled, (
        plan.cost.peak_memory_bytes,
        compiled,
    )


def test_tokens_of_the_whole_batch_come_out_of_the_loop_in_order():
    """A per-token activation (the batch merged with the sequence, as MoE layers and
    routers write `x.reshape(-1, d)`) that the rest of the step needs whole comes out
    of the loop put back example by example: micro-batches are strided over examples,
    so each example's tokens stay together (they were interleaved token by token, and
    every gradient below such a statistic was wrong)."""
    import jax.numpy as jnp

    b, s, d, f = 16, 8, 32, 64

    def grads(w, batch):
        def loss(w):
            t = batch["x"].reshape(-1, d)  # tokens
            h = jnp.tanh(t @ w)
            m = jnp.mean(h, axis=0)  # a statistic of the whole batch, read per token
            out = (h * m).reshape(*batch["x"].shape[:2], f)  # back to examples, as MoE returns
            return jnp.sum((out - batch["y"]) ** 2) / t.shape[0]

        return jax.value_and_grad(loss)(w)

    w = jnp.cos(jnp.arange(d * f, dtype=jnp.float32).reshape(d, f) * 0.1) / 4
    batch = {
        "x": jnp.sin(jnp.arange(b * s * d, dtype=jnp.float32).reshape(b, s, d) * 0.37),
        "y": jnp.cos(jnp.arange(b * s * f, dtype=jnp.float32).reshape(b, s, f) * 0.11) / 8,
    }
    step = autopar.parallelize(grads, mesh={"data": 2}, cluster=CLUSTER, grad_accumulation=4)
    plan = step.plan(w, batch)
    assert any(o.op == "scan" for o in plan.ops)  # the step is accumulated
    assert_trees_close(step(w, batch), jax.jit(grads)(w, batch), what="loss and gradient")


def test_each_micro_batch_draws_its_own_dropout_mask():
    """Dropout under accumulation: each micro-batch folds its index into the key, so the
    masks differ between micro-batches (drawn from the step's key alone they were equal:
    every feature's kept count over the batch a multiple of M); the plan says the draw is
    not jax.jit's."""
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np

    b, n, m = 16, 64, 4

    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.zeros, (n,))
            return nn.Dropout(0.5, deterministic=False)(x) @ w

    model = Drop()

    def grads(params, key, x):  # d loss / d w = kept mask summed over the batch
        loss = lambda p: model.apply(p, x, rngs={"dropout": key}).mean()
        return jax.grad(loss)(params)

    x = jnp.ones((b, n)) + 0 * jnp.arange(b * n, dtype=jnp.float32).reshape(b, n)
    params = model.init(jax.random.key(0), x)
    step = autopar.parallelize(grads, mesh={"data": 4}, cluster=CLUSTER, grad_accumulation=m)
    # named by where they are drawn (a diffusion step's noise is no dropout mask)
    with pytest.warns(UserWarning, match=r"random numbers \(test_accumulate.py:\d+ .*drawn per"):
        g = step(params, jax.random.key(1), x)
    kept = np.round(np.asarray(g["params"]["w"]) * b * 0.5).astype(int)
    assert np.any(kept % m), kept  # not the same mask in every micro-batch
    plan = step.plan(params, jax.random.key(1), x)
    assert any("drawn per micro-batch" in w for w in plan.warnings), plan.warnings


def test_a_step_that_needs_the_whole_batch_early_says_so():
    """Batch norm's statistics need the whole batch: almost nothing can run micro-batch by
    micro-batch, and the plan says which op held the rest back."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(16, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=False)(x)
            return nn.Dense(4)(nn.relu(x).mean(axis=(1, 2)))

    model = Net()

    def step(variables, batch):
        def loss(p):
            out, new = model.apply(
                {"params": p, "batch_stats": variables["batch_stats"]},
                batch["x"],
                mutable=["batch_stats"],
            )
            return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean(), new

        (value, new), g = jax.value_and_grad(loss, has_aux=True)(variables["params"])
        return g, new, value

    x = jnp.sin(jnp.arange(16 * 8 * 8 * 3, dtype=jnp.float32).reshape(16, 8, 8, 3))
    batch = {"x": x, "y": jnp.arange(16) % 4}
    variables = model.init(jax.random.key(0), x)
    step_ = autopar.parallelize(step, mesh={"data": 4}, cluster=CLUSTER, grad_accumulation=4)
    with pytest.warns(
        UserWarning,
        match=r"only \d+% of the step's FLOPs .* from .*test_accumulate.* a sum over the examples",
    ):
        plan = step_.plan(variables, batch)
    assert any("needs the whole batch" in w for w in plan.warnings), plan.warnings


def test_layers_under_a_scan_accumulate_like_jax_jit():
    """A step whose layers run in a `scan` (`nn.scan`): the loop over layers runs inside
    the micro-batch loop, its carry one micro-batch's activations (it was left out of
    the loop, which then held 1% of the step's FLOPs and saved no memory)."""
    cfg = gpt.GPTConfig(
        hidden=64, heads=4, seq=32, vocab=256, layers=2, batch_size=16, scan_layers=True
    )
    ts = gpt.make_train_step(cfg)
    step = autopar.parallelize(ts.step, mesh=MESH, cluster=CLUSTER, grad_accumulation=4)
    state = jax.jit(ts.init)(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "only 1% of the step's FLOPs" warning
        plan = step.plan(state, ts.batch(0))
    (loop,) = [o for o in plan.ops if o.op == "scan"]
    assert loop.key.startswith("grad_accumulation/")
    assert any(o.op == "scan" for o in loop.body.ops)  # the layers' loop, per micro-batch
    _trains_like_jax_jit(ts, step, state, 2)


def test_nnx_layers_under_a_scan_accumulate_their_state_like_nnx_jit():
    """NNX blocks made with `nnx.vmap` and run with `nnx.scan`, each counting its calls
    in a Variable: the counts the layers' loop returns are the same in every micro-batch
    and leave the micro-batch loop as the last one's (they could not leave it at all)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.fc1, self.fc2 = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls[...] = self.calls[...] + 1
            return x + self.fc2(nnx.gelu(self.fc1(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):
                return Block(rngs)

            self.blocks, self.head = blocks(rngs), nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(x, block):
                return block(x)

            return self.head(forward(x, self.blocks))

    def step(model, opt, batch):
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    def make():
        model = Model(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def batch(i):
        x = jnp.sin(jnp.arange(16 * 32).reshape(16, 32) * (0.01 + 0.003 * i))
        return x, jnp.cos(x[:, :8])

    par = autopar.parallelize(step, mesh=MESH, cluster=CLUSTER, grad_accumulation=4)
    ref = nnx.jit(step)
    (m_a, o_a), (m_b, o_b) = make(), make()
    for i in range(2):
        assert_trees_close(par(m_b, o_b, batch(i)), ref(m_a, o_a, batch(i)), what=f"loss {i}")
    assert m_b.blocks.calls[...].tolist() == [2, 2, 2]
    assert_trees_close(nnx.state(m_b), nnx.state(m_a), atol=2e-3, what="model state")


def test_accumulated_gradients_summed_in_the_loop_where_the_optimizer_splits_their_sums():
    """T5 with Adafactor on data 8: carried as Partial sums, the gradients are summed
    after the loop, where Adafactor's per-parameter chains keep XLA from combining
    their all-reduces (a trial's T5: 112 of them, 10x the step). The loop also offers
    data parallelism with each micro-batch's gradients summed in it (`dp+reduced`),
    which the polish takes where it prices lower."""
    from benchmarks.user_models_defs import t5

    case = t5(dict(batch=16, seq=32, vocab=1024, d=128, heads=4, ffn=512, layers=1))
    plan = autopar.parallelize(case.step, mesh={"data": 8}, grad_accumulation=2).plan(
        *case.args(False)
    )
    (loop,) = [o for o in plan.ops if o.op == "scan"]
    assert not any(s.partial for s in loop.in_specs), loop.in_specs


def test_micro_batches_too_small_to_split_say_so():
    """4 examples a micro-batch on 8 devices: the plan ran 94% of a T5 step replicated
    and said so only in its summary's `work:` line."""
    from benchmarks.user_models_defs import t5

    case = t5(dict(batch=16, seq=32, vocab=1024, d=128, heads=4, ffn=512, layers=1))
    step = autopar.parallelize(case.step, mesh=MESH, grad_accumulation=4)
    with pytest.warns(
        UserWarning,
        match=r"a micro-batch has 4 examples for 8 devices.*grad_accumulation=2 \(micro-batches of 8\)",
    ):
        plan = step.plan(*case.args(False))
    assert plan.replicated_share() > 0.5


def _picking_step(loss_of):
    """An MLP's SGD step whose loss is `loss_of(logits, labels)`."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))

    model, tx = MLP(), optax.sgd(0.1)

    def step(params, opt_state, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: loss_of(model.apply(p, x), y))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jnp.sin(jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32) * 0.37)
    y = (jnp.arange(16) * 7) % 10
    params = model.init(jax.random.key(0), x)
    return step, (params, tx.init(params)), (x, y)


def _equal_to_jit(step, state, batch):
    par = autopar.parallelize(step, mesh={"data": 2, "model": 4}, grad_accumulation=2)
    ref, a, b = jax.jit(step), state, state
    for i in range(2):
        shifted = (batch[0] + i, batch[1])
        *a, loss_a = ref(*a, shifted)
        *b, loss_b = par(*b, shifted)
        assert_trees_close(loss_b, loss_a, what=f"loss, step {i}")
    assert_trees_close(b, a, what="params and optimizer state after 2 steps")
    return par.plan(*state, batch)


def test_a_pick_by_jnp_arange_over_the_batch_runs_per_micro_batch():
    """`logp[jnp.arange(B), labels]`: traced at the micro-batch size, `arange` holds the
    micro-batch's own positions, which pick its own rows. Taken for rows of the whole
    batch's positions, the positions left the loop uncut out of order and the loss was
    another (2.380 against 2.343); now the whole step runs per micro-batch, as with
    `jnp.take_along_axis`, and trains as `jax.jit` does."""
    import jax.numpy as jnp

    def loss_of(logits, y):
        return -jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), y].mean()

    step, state, batch = _picking_step(loss_of)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "only N% ... per micro-batch" warning
        plan = _equal_to_jit(step, state, batch)
    assert not any("needs the whole batch" in w for w in plan.warnings), plan.warnings


def test_positions_that_cannot_run_per_micro_batch_stay_with_the_whole_batch():
    """`jnp.arange(B) < 12` weights the first 12 examples: per micro-batch its positions
    would be the micro-batch's own, another mask. It runs on the whole batch, as
    `jax.jit` runs it, and the warning names the positions and a way around them."""
    import jax.numpy as jnp

    def loss_of(logits, y):
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]
        return jnp.sum(ce * (jnp.arange(logits.shape[0]) < 12)) / 12

    step, state, batch = _picking_step(loss_of)
    with pytest.warns(UserWarning, match=r"from iota at .*positions along the batch"):
        _equal_to_jit(step, state, batch)


def test_a_contrastive_loss_over_the_batch_accumulates_like_jax_jit():
    """CLIP's loss: a batch x batch logits matrix, labels `jnp.arange(B)`. It needs the
    whole batch (the warning names the matrix's dot) and equals `jax.jit`'s: the
    positions were cut as rows of the whole batch's and it was neither that loss nor
    the micro-batches' mean."""
    import jax.numpy as jnp
    import optax

    def loss_of(emb, y):
        img, txt = (
            e / jnp.linalg.norm(e, axis=-1, keepdims=True) for e in (emb[:, :5], emb[:, 5:])
        )
        logits = img @ txt.T * 10.0  # two towers' embeddings: halves of the logits
        labels = jnp.arange(logits.shape[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    step, state, batch = _picking_step(loss_of)
    with pytest.warns(UserWarning, match=r"needs the whole batch from dot_general"):
        _equal_to_jit(step, state, batch)


def test_a_token_weighted_loss_counts_its_tokens_on_the_whole_batch():
    """`(loss * mask).sum() / mask.sum()`, as seq2seq and `transformers` code weights
    tokens: the count reads the labels alone, so it is computed on the whole batch
    before the loop and the rest accumulates (the division stopped the loop: two
    thirds of the step ran on the whole batch, its memory above no accumulation's);
    trains as `jax.jit` does."""
    import jax.numpy as jnp
    import optax

    def loss_of(logits, y):
        labels = jnp.where(jnp.arange(10)[None, :] < y[:, None], 0, 10)[:, :4]  # pads: 10
        mask = (labels != 10).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(
            jnp.repeat(logits[:, None], 4, 1), jnp.minimum(labels, 9)
        )
        return (ce * mask).sum() / mask.sum()

    step, state, batch = _picking_step(loss_of)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "only N% ... per micro-batch" warning
        plan = _equal_to_jit(step, state, batch)
    assert any("1 statistic of the batch alone" in w for w in plan.warnings), plan.warnings
