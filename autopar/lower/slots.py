"""The slot loops of a 1F1B pipeline (`autopar.lower.pipeline.run_1f1b`): which pass
each stage runs in each slot of the lock-step, zero-bubble and alternating schedules.
Each takes the pipeline's state `st` and the passes `run_1f1b` defines over it (a
micro-batch's forward pass, the head, its backward pass or its two parts) and returns
the state after the last slot; `s` is this device's stage (inside `shard_map`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autopar.passes.interleave import interleaved_pass


def lock_step(st: dict, s, S: int, M: int, fw, bw, forward, turn, backward) -> dict:
    """Lock-step 1F1B: `S - 1` forward slots, `M` ticks of a forward slot, the head
    and a backward slot, then `S - 1` backward slots; every carry hops each slot."""

    def warm(st, slot):
        forward(st, slot - s)
        st["fc"] = fw.hop(st["fc"])
        return st, None

    def steady(st, k):
        # forward slot S - 1 + k brings micro-batch k to the end of the last stage,
        # whose head turns it around for backward slot k
        fc, mc = forward(st, S - 1 + k - s)
        st["fc"] = fw.hop(fc)
        backward(st, k - (S - 1 - s), turn(st, fc, mc))
        st["bc"] = bw.hop(st["bc"])
        return st, None

    def cool(st, slot):
        backward(st, slot - (S - 1 - s), None)
        st["bc"] = bw.hop(st["bc"])
        return st, None

    st, _ = jax.lax.scan(warm, st, jnp.arange(S - 1))
    st, _ = jax.lax.scan(steady, st, jnp.arange(M))
    st, _ = jax.lax.scan(cool, st, jnp.arange(M, M + S - 1))
    return st


def zero_bubble(
    st: dict, s, S: int, M: int, fw, bw, forward, turn, input_grads, weight_grads
) -> dict:
    """Lock-step 1F1B with the weight gradients deferred (ZB-H1): the slots of
    `lock_step`, but a backward slot runs a micro-batch's input gradient only, and
    the weight gradients of micro-batch `t - (S - 1)` follow on every stage in
    backward slot `t`, from the first slot in which the first stage has a backward
    pass on (slot `S - 1`). So the `S - 1` backward slots of the ramp up, in which
    the later stages wait for the first one anyway, carry no weight gradients: the
    step is `S - 1` weight-gradient passes shorter than 1F1B's. Stage `s` runs a
    micro-batch's weight gradients `s` slots after its input gradient, the last
    stage's during the ramp down, in which it would wait anyway."""

    def warm(st, slot):
        forward(st, slot - s)
        st["fc"] = fw.hop(st["fc"])
        return st, None

    def steady(with_w: bool):
        def tick(st, k):
            fc, mc = forward(st, S - 1 + k - s)
            st["fc"] = fw.hop(fc)
            input_grads(st, k - (S - 1 - s), turn(st, fc, mc))
            st["bc"] = bw.hop(st["bc"])
            if with_w:
                weight_grads(st, k - (S - 1))
            return st, None

        return tick

    def cool(st, slot):
        input_grads(st, slot - (S - 1 - s), None)
        st["bc"] = bw.hop(st["bc"])
        weight_grads(st, slot - (S - 1))
        return st, None

    st, _ = jax.lax.scan(warm, st, jnp.arange(S - 1))
    st, _ = jax.lax.scan(steady(False), st, jnp.arange(min(M, S - 1)))
    if M > S - 1:
        st, _ = jax.lax.scan(steady(True), st, jnp.arange(S - 1, M))
    st, _ = jax.lax.scan(cool, st, jnp.arange(M, M + S - 1))
    return st


def alternating(st: dict, s, S: int, M: int, fw, bw, parts, branch: bool) -> dict:
    """1F1B with stages alternating forward and backward half-slots (Megatron's
    schedule, lock-step): in slot `t` stage `s` runs the forward pass of micro-batch
    `(t - s) / 2` when `t - s` is even, else the backward pass of micro-batch
    `(t - 2S + 1 + s) / 2`; `2 (M + S - 1)` slots. A stage's pass is a `lax.switch`
    (every device of a stage takes the same branch; a slot with no micro-batch runs
    nothing); the head runs after it, on every stage (kept on the last stage only),
    right after the last stage's forward pass of a micro-batch: `M` times, every
    device taking the same branch of a `lax.cond`. A carry hops from the stages that
    made it in that slot only.

    Without `branch` (XLA:CPU, `BRANCHES_ON_CPU`) every stage runs the forward pass
    and then the backward pass in every slot, each result kept only where the slot
    holds it: the same results and buffers, twice the compute. XLA:CPU runs a
    collective-permute (a change of layout, in the head or a stage's layers) inside a
    branch as a rendezvous of every device, which hangs when only some stages take the
    branch."""
    f_in, f_keep, b_in, b_keep, turn = parts
    zero_h = jax.eval_shape(lambda st: turn(dict(st), st["fc"], 0, False), st)
    st = {**st, "hv": jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), zero_h)}

    def last_m(t):  # the last stage's micro-batch in forward slot t: the same on every device
        return (t - (S - 1)) // 2

    def head(st, t):
        st = dict(st)
        hv = turn(st, st["fc"], last_m(t))
        st["hv"] = {v: jnp.where(s == S - 1, hv[v], st["hv"][v]) for v in hv}
        return st

    def half(st, t, parity: int):
        is_f = s % 2 == parity  # stages of this parity run forward passes in slot t
        m = jnp.where(is_f, t - s, t - (2 * S - 1 - s)) // 2
        on = (m >= 0) & (m < M)

        def idle(st):
            return st

        def fwd(st):
            st = dict(st)
            _, mc, xs, fc = f_in(st, m)
            f_keep(st, on & is_f, mc, *fw.pin(*fw.run(xs, fc, mc)))
            return st

        def back(st):
            st = dict(st)
            _, mc, xs, bc = b_in(st, m, st["hv"])
            b_keep(st, on & ~is_f, mc, *bw.pin(*bw.run(xs, bc, mc)))
            return st

        if branch:
            st = jax.lax.switch(jnp.where(~on, 0, jnp.where(is_f, 1, 2)), [idle, fwd, back], st)
        else:  # each stage's carry of the pass it does not run is garbage no one reads
            st = back(fwd(st))
        if parity == (S - 1) % 2:  # the last stage ran the forward pass of micro-batch m
            st = jax.lax.cond((last_m(t) >= 0) & (last_m(t) < M), head, lambda st, t: st, st, t)
        st["fc"] = fw.hop(st["fc"], [i for i in range(S) if i % 2 == parity])
        st["bc"] = bw.hop(st["bc"], [i for i in range(S) if i % 2 != parity])
        return st

    def pair(st, j):
        return half(half(st, 2 * j, 0), 2 * j + 1, 1), None

    st, _ = jax.lax.scan(pair, st, jnp.arange(M + S - 1))
    return st


def interleaved(st: dict, s, S: int, M: int, v: int, fw, bw, forward, turn, backward) -> dict:
    """Lock-step interleaved 1F1B over `v` chunks of layers per stage (stage `s` runs
    virtual stages `s, S + s, ..., (v - 1) S + s`). Passes are numbered in the order a
    stage runs them: forward pass `j` is micro-batch `g S + r` through chunk `c`, for
    `j = g S v + c S + r` (micro-batches in groups of `S`, each group through every
    chunk before the next); backward pass `j` likewise with the chunks reversed. In slot
    `t` stage `s` runs forward pass `t - s` and backward pass `t - (v S - 1) - (S - 1 - s)`:
    a carry hops one stage per slot, from the last stage round to the first one's next
    chunk, and the last stage's last chunk turns a micro-batch round (the head) in the
    slot its backward pass starts. `M v + S - 1` forward slots, as many backward ones,
    `v S - 1` apart: the ramps last `S - 1` chunks' passes, 1/v of lock-step 1F1B's.
    The head runs in a `lax.cond` that every device takes alike (it depends on the
    slot only). Needs `M` a multiple of `S`."""
    D = v * S - 1

    def job(j, backward_pass: bool):
        m, c = interleaved_pass(jnp.clip(j, 0, M * v - 1), S, v, backward_pass)
        on = (j >= 0) & (j < M * v)
        return jnp.where(on, m, -1), c

    zero_h = jax.eval_shape(lambda st: turn(dict(st), st["fc"], 0, False), st)
    zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), zero_h)

    def fwd(st, t):
        m, c = job(t - s, False)
        fc, mc = forward(st, m, c)
        st["fc"] = fw.hop(fc)
        return fc, mc

    def bwd(st, t, hv):
        m, c = job(t - D - (S - 1 - s), True)
        backward(st, m, hv, c)
        st["bc"] = bw.hop(st["bc"])

    def warm(st, t):
        fwd(st, t)
        return st, None

    def steady(st, t):
        fc, mc = fwd(st, t)
        # the last stage's forward pass in slot t: its chunk is the last one on every device
        j = t - (S - 1)
        turns = (j >= 0) & (j < M * v) & (interleaved_pass(j, S, v)[1] == v - 1)

        def head(st):
            st = dict(st)
            return st, turn(st, fc, mc)

        st, hv = jax.lax.cond(turns, head, lambda st: (dict(st), zeros), st)
        bwd(st, t, hv)
        return st, None

    def cool(st, t):
        bwd(st, t, None)
        return st, None

    T = M * v + S - 1
    st, _ = jax.lax.scan(warm, st, jnp.arange(D))
    st, _ = jax.lax.scan(steady, st, jnp.arange(D, T))
    st, _ = jax.lax.scan(cool, st, jnp.arange(T, T + D))
    return st
