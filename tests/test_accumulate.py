"""Gradient accumulation: the per-micro-batch part of a step in a loop, the optimizer once."""

from __future__ import annotations

import functools

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


def test_accumulated_training_matches_single_device():
    ts, step = _accumulating()
    state = jax.jit(ts.init)(0)
    losses, _ = run_steps(step, state, ts.batch, 3)
    ref_losses, ref_states = run_steps(jax.jit(ts.step), state, ts.batch, 3, keep_states=True)
    for i in range(3):
        assert_trees_close(losses[i], ref_losses[i], what=f"loss at step {i}")
    one, _ = step(state, ts.batch(0))
    # moments are scaled gradients (tight); Adam turns noise-level gradients into
    # full-size steps, so parameters compare at the step size
    assert_trees_close(one["opt_state"], ref_states[0]["opt_state"], what="optimizer state")
    assert_trees_close(one["params"], ref_states[0]["params"], atol=2e-3, what="params")

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
