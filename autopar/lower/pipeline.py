"""A pipelined scan: GPipe or 1F1B (lock-step or alternating) over the mesh's stage
axis, inside one jitted program.

The loop's per-layer inputs (`xs`: weights, saved activations) and outputs (`ys`) are
split over the stage axis along the layer dim, so stage `s` holds layers
`[s k, (s + 1) k)`. The rest is replicated over that axis. In `shard_map`, manual over
the stage axis only (the data/model axes stay with XLA's partitioner and the body's
own plan), the program runs in lock-step slots; in a forward slot `i` stage `s` runs
micro-batch `i - s` through its `k` layers (a `lax.scan` of the micro-batch body) and
passes the carry on with `ppermute` (a collective-permute); a reversed loop (a
backward pass) runs from the last stage to the first. A stage with no micro-batch in a
slot (the pipeline filling or draining) computes on zeros and drops the result: it
would wait anyway. (`lax.cond` could skip it, but XLA:CPU deadlocks on a collective-permute
in a branch that only some devices take.)

GPipe (`run_gpipe`): `M + S - 1` forward slots, then as a separate pipeline
`M + S - 1` backward ones; each stage keeps all `M` micro-batches' saved activations
in between. 1F1B (`run_1f1b`): the forward loop, the head between the loops (loss
and its gradient, per micro-batch, on the last stage) and the backward loop in one
pipeline of `S - 1` forward slots, then `M` ticks of a forward slot, the head and a
backward slot, then `S - 1` backward slots. The critical path is the same
`(M + S - 1)` forward and backward slots as GPipe's (plus `M` heads), but stage `s`
frees a micro-batch's activations `2 (S - 1 - s)` slots after saving them, so it holds
at most `2S - 1` micro-batches' worth whatever `M` is. The alternating 1F1B
(Megatron's schedule) runs `2 (M + S - 1)` half-slots in which the stages alternate
forward and backward passes, so stage `s` holds `S - s`; a half-slot lasts the slower
of the two passes. ZB-H1 runs lock-step 1F1B's slots with each backward pass cut in
two (`autopar.passes.zero_bubble`): the input gradient in the backward slot, the
weight gradients of an earlier micro-batch after it, none in the ramp up, from a ring
of what they read. The interleaved 1F1B runs slots of one of `v` chunks of a stage's
layers (stage `s` holds virtual stages `s, S + s, ...`), its carry hopping round a ring
of the stages; the loops' per-layer inputs are moved from layer order into that chunk
order on entry, and the per-layer outputs back (`autopar.lower.interleave`).
`autopar.lower.slots` has the four schedules' slot loops.

Micro-batch `m` of a batched value is the strided slice `m::M` of its batch dim, so a
batch dim sharded over `data` stays sharded the same way in every micro-batch. A
loop-invariant input broadcast whole from a batch-free operand (a mask or fill JAX
hoisted out of the loop; `autopar.passes.pipeline.sunk_fills`) enters as that operand,
and each stage broadcasts one micro-batch's worth where it reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from autopar.ir.graph import Graph, Node
from autopar.lower import slots
from autopar.lower.devices import branches, summed
from autopar.lower.interleave import from_chunks, to_chunks
from autopar.passes.interleave import interleaved_number, interleaved_slots
from autopar.passes.microbatch import cut, uncut
from autopar.passes.pipeline import (
    SAME,
    SUM,
    Fused,
    Label,
    ScanLabels,
)
from autopar.passes.zero_bubble import WeightSplit


def _at(x, lab: Label, mc, xs: bool):
    """Micro-batch `mc` of a staged input (`xs`: its micro-batch dim follows the layers)."""
    if lab == SAME:
        return x
    return jax.lax.dynamic_index_in_dim(x, mc, axis=int(xs), keepdims=False)


class PipelinedLoop:
    """One pipelined scan as the staged program sees it: its inputs cut into
    micro-batches (`staged`), one stage's `k` layers for one micro-batch (`run`), and
    the buffers its outputs fill (`ys0`, `accumulate`, `finish`)."""

    def __init__(
        self,
        node: Node,
        micro_body: Graph,
        labels: ScanLabels,
        run_body,
        pipe,
        mesh,
        out_specs,
        fills: Mapping[int, Sequence[int]] = {},  # noqa: B006
        split: WeightSplit | None = None,
        run_split: tuple[Callable, Callable] | None = None,
    ):
        p = node.params
        # zero-bubble (ZB-H1): the body as its input-gradient part and its weight
        # gradients (`autopar.passes.zero_bubble`), each interpreted under the body's plan
        self.split, self.run_split = split, run_split
        self.boundary_types = (
            [micro_body.values[v] for v in split.boundary] if split is not None else []
        )
        # sunk fills (`autopar.passes.pipeline.sunk_fills`): input -> the broadcast's
        # dims; the input enters as the batch-free operand, broadcast per micro-batch
        self.fills = dict(fills)
        self.in_types = [micro_body.values[v] for v in micro_body.inputs]
        self.node, self.labels, self.run_body, self.pipe = node, labels, run_body, pipe
        self.n_c, self.n_k, self.reverse = p["num_consts"], p["num_carry"], p["reverse"]
        self.k = p["length"] // pipe.stages
        self.v = pipe.virtual
        self.kc = self.k // self.v  # layers per slot: the stage's, or one chunk's
        self.is_x = [i >= self.n_c + self.n_k for i in range(len(node.inputs))]
        outs = micro_body.outputs
        # a Partial output is stacked: one summand per device of its partial axes
        self.stacks = [
            (math.prod(mesh.shape[a] for a in sp.partial),) if sp.partial else ()
            for sp in out_specs[self.n_k :]
        ]
        self.out_specs = out_specs
        self.y_labels = labels.outs[self.n_k :]
        self.y_types = [micro_body.values[v] for v in outs[self.n_k :]]
        self.carry_types = [micro_body.values[v] for v in outs[: self.n_k]]

    def staged(self, i: int, x):
        """Input `i` with micro-batches stacked in front (consts, carry) or after the
        layer dim (xs)."""
        lab, xs = self.labels.ins[i], int(self.is_x[i])
        if lab == SAME or i in self.fills:
            return x
        return cut(x, lab + xs, self.pipe.microbatches, lead=xs)

    def spec(self, i: int) -> PartitionSpec:
        return PartitionSpec(self.pipe.axis) if self.is_x[i] else PartitionSpec()

    def pick(self, i: int, x, mc, c=None):
        """Input `i` at micro-batch `mc` (and, interleaved, chunk `c`'s layers)."""
        if i in self.fills:
            t = self.in_types[i]
            return jax.lax.broadcast_in_dim(x, t.shape, tuple(self.fills[i]))
        if c is not None and self.is_x[i]:
            x = jax.lax.dynamic_slice_in_dim(x, c * self.kc, self.kc, axis=0)
        return _at(x, self.labels.ins[i], mc, self.is_x[i])

    def pos(self, s):
        return self.pipe.stages - 1 - s if self.reverse else s

    def init(self, args, mc) -> list:
        return [jnp.asarray(a)[mc] for a in args[self.n_c : self.n_c + self.n_k]]

    def run(self, args, carry, mc, chunk: bool = False) -> tuple[list, list]:
        """Micro-batch `mc` through this stage's layers (`chunk`: one chunk's); `args`
        are its inputs picked at that micro-batch (`xs` with the layers in front). Its
        random draws fold `mc` into their keys: each micro-batch draws its own masks."""
        consts, xs = args[: self.n_c], args[self.n_c + self.n_k :]

        def layer(c, x):
            outs = self.run_body(*consts, *c, *x, index=mc)
            return list(outs[: self.n_k]), list(outs[self.n_k :])

        k = self.kc if chunk else self.k
        return jax.lax.scan(layer, list(carry), list(xs), length=k, reverse=self.reverse)

    def run_b(self, args, carry, mc) -> tuple[list, list]:
        """`run` of the input-gradient part only: the carry, and the boundary values
        the weight gradients read (`WeightSplit`), per layer."""
        consts, xs = args[: self.n_c], args[self.n_c + self.n_k :]
        run_b = self.run_split[0]

        def layer(c, x):
            outs = run_b(*consts, *c, *x, index=mc)
            return list(outs[: self.n_k]), list(outs[self.n_k :])

        return jax.lax.scan(layer, list(carry), list(xs), length=self.k, reverse=self.reverse)

    def run_w(self, args, boundary, mc) -> list:
        """The weight gradients of this stage's layers (the `ys` `run` returns), from
        the inputs picked at their micro-batch and `run_b`'s boundary values."""
        consts = [args[i] for i in self.split.w_inputs if i < self.n_c]
        xs = [args[i] for i in self.split.w_inputs if i >= self.n_c]
        run_w = self.run_split[1]

        def layer(_, x):
            return None, list(run_w(*consts, *x, index=mc))

        _, ys = jax.lax.scan(layer, None, [*xs, *boundary], length=self.k)
        return ys

    def boundary0(self, slots: int) -> list:
        return [jnp.zeros((slots, self.k, *t.shape), t.dtype) for t in self.boundary_types]

    def pin(self, carry, ys) -> tuple[list, list]:
        """A run's results in the layouts the body's plan makes them (its carry, and
        its per-layer outputs stacked over this stage's layers), where XLA would
        otherwise pick one of its own (the results of a `lax.switch`)."""
        carry = [_pin(x, sp.to_pspec()) for x, sp in zip(carry, self.out_specs[: self.n_k])]
        return carry, [_pin(y, self.y_pspec(j)) for j, y in enumerate(ys)]

    def y_pspec(self, j: int, lead: int = 1) -> PartitionSpec:
        """The layout of per-layer output `j` stacked over this stage's layers (and
        `lead - 1` more leading dims, e.g. micro-batch slots), as the body makes it."""
        sp = self.out_specs[self.n_k + j]
        return PartitionSpec(*[None] * lead, *(sp.stacked_pspec() if sp.partial else sp.to_pspec()))

    def carry0(self) -> list:
        return [jnp.zeros(t.shape, t.dtype) for t in self.carry_types]

    def out0(self) -> list:
        return [jnp.zeros((self.pipe.microbatches, *t.shape), t.dtype) for t in self.carry_types]

    def _ys(self, only: Sequence[int] | None) -> list[int]:
        return list(range(len(self.y_labels))) if only is None else list(only)

    def ys0(self, only: Sequence[int] | None = None) -> list:
        """Buffers of the per-layer outputs (those numbered in `only`; all by default)."""
        M, k = self.pipe.microbatches, self.k
        shape = lambda j: (  # noqa: E731
            (k, *self.stacks[j]) if self.y_labels[j] in (SUM, SAME) else (k, M)
        )
        return [
            jnp.zeros((*shape(j), *self.y_types[j].shape), self.y_types[j].dtype)
            for j in self._ys(only)
        ]

    def accumulate(self, ys, y, mc, active, c=None, only: Sequence[int] | None = None) -> list:
        """Micro-batch `mc`'s per-layer outputs (those numbered in `only`) folded into
        their buffers (interleaved: chunk `c`'s rows)."""
        labels = [self.y_labels[j] for j in self._ys(only)]
        if c is None:
            return [_accumulate(b, v, lab, mc, active) for b, v, lab in zip(ys, y, labels)]
        out = []
        for b, v, lab in zip(ys, y, labels):
            rows = jax.lax.dynamic_slice_in_dim(b, c * self.kc, self.kc, axis=0)
            rows = _accumulate(rows, v, lab, mc, active)
            out.append(jax.lax.dynamic_update_slice_in_dim(b, rows, c * self.kc, axis=0))
        return out

    def hop(self, carry, senders: Sequence[int] | None = None) -> list:
        """The carry passed on to the next stage, from `senders` (every stage when
        None; the others' next stage gets zeros)."""
        S, step = self.pipe.stages, -1 if self.reverse else 1
        senders = range(S) if senders is None else senders
        if self.v > 1:  # interleaved: the last stage's chunk goes on to the first stage's next
            perm = [(i, (i + step) % S) for i in senders]
        else:
            perm = [(i, i + step) for i in senders if 0 <= i + step < S]
        if not perm:
            return [jnp.zeros_like(c) for c in carry]
        return [jax.lax.ppermute(c, self.pipe.axis, perm) for c in carry]

    def finish_carry(self, out) -> list:
        return [uncut(c, lab) for c, lab in zip(out, self.labels.outs[: self.n_k])]

    def finish_ys(self, ys, only: Sequence[int] | None = None) -> list:
        js = self._ys(only)
        return [
            (jnp.moveaxis(y, 1, 0) if self.stacks[j] else y)
            if self.y_labels[j] in (SUM, SAME)
            else uncut(y, self.y_labels[j] + 1, lead=1)
            for y, j in zip(ys, js)
        ]


def _pin(x, pspec: PartitionSpec):
    """`x` laid out as `pspec` on the mesh of the enclosing (partly manual) program."""
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(jax.sharding.get_abstract_mesh(), pspec)
    )


def _collect(out, carry, mc, on) -> list:
    return [jnp.where(on, o.at[mc].set(c), o) for o, c in zip(out, carry)]


def run_gpipe(loop: PipelinedLoop, mesh, invals: Sequence) -> list:
    """The scan's outputs, computed by a GPipe pipeline over the stage axis. A per-layer
    sum the body returns Partial (stacked, one summand per device) is accumulated over
    micro-batches as it is and comes out stacked, [devices, layers, ...], to be summed
    across devices once."""
    pipe = loop.pipe
    S, M, axis = pipe.stages, pipe.microbatches, pipe.axis
    n = len(invals)

    def staged(*args):
        pos = loop.pos(jax.lax.axis_index(axis))

        def tick(state, t):
            carry, out, ys = state
            m = t - pos
            active = (m >= 0) & (m < M)
            mc = jnp.clip(m, 0, M - 1)
            carry = [jnp.where(pos == 0, i, c) for i, c in zip(loop.init(args, mc), carry)]
            picked = [loop.pick(i, a, mc) for i, a in enumerate(args)]
            carry, y = loop.run(picked, carry, mc)
            ys = loop.accumulate(ys, y, mc, active)
            out = _collect(out, carry, mc, active & (pos == S - 1))
            return (loop.hop(carry), out, ys), None

        state = (loop.carry0(), loop.out0(), loop.ys0())
        (_, out, ys), _ = jax.lax.scan(tick, state, jnp.arange(M + S - 1))
        return (*summed(out, axis, mesh), *ys)

    f = jax.shard_map(
        staged,
        mesh=mesh,
        in_specs=tuple(loop.spec(i) for i in range(n)),
        out_specs=(PartitionSpec(),) * loop.n_k + (PartitionSpec(axis),) * len(loop.y_labels),
        axis_names={axis},
        check_vma=False,
    )
    results = f(*[loop.staged(i, x) for i, x in enumerate(invals)])
    return [*loop.finish_carry(results[: loop.n_k]), *loop.finish_ys(results[loop.n_k :])]


def run_1f1b(
    fused: Fused,
    fw: PipelinedLoop,
    bw: PipelinedLoop,
    run_head: Callable[[dict, object], dict],
    mesh,
    f_in: Sequence,
    b_in: Mapping[int, object],
    h_in: Sequence,
    keep: frozenset[int],
    resident: frozenset[int] = frozenset(),
) -> tuple[list, list, dict]:
    """The forward loop, the head and the backward loop of `fused` as one 1F1B
    pipeline, lock-step or alternating (`pipe.schedule`: "1f1b", "1f1b-async"; the
    module's docstring). `f_in`: the forward loop's inputs; `b_in`: the backward loop's
    inputs from outside the region, by position; `h_in`: the values of
    `fused.head_ins` not made by the forward loop; `keep`: the forward loop's outputs
    the rest of the step reads; `resident`: interleaved, the per-layer inputs and
    outputs already in chunk order (`autopar.passes.interleave.resident`). Returns the forward loop's outputs (None where not
    kept), the backward loop's, and the head's `head_outs` by value id."""
    pipe = fw.pipe
    S, M, axis = pipe.stages, pipe.microbatches, pipe.axis
    alternate = pipe.schedule == "1f1b-async"
    # ZB-H1 with no weight gradients to defer (`split_weight_grads` found none) is 1F1B
    zero_bubble = pipe.schedule == "zb-h1" and bw.split is not None
    V = pipe.virtual  # interleaved: chunks per stage; a saved activation is one chunk's
    # saved activations held per stage; interleaved: chunk passes, in the slots
    # `interleaved_slots` gives each (its static schedule's interval colouring)
    R = min(M, S) if alternate else min(M, 2 * S - 1)
    if V > 1:
        R, slot_table = interleaved_slots(S, M, V)
    # zero-bubble: stage s runs a micro-batch's weight gradients s slots after its
    # input gradient, so it keeps that many micro-batches' boundary values and one more
    Q = min(M, S)
    F, B = fw.node, bw.node
    f_outs = list(F.outputs)
    ys_f = f_outs[fw.n_k :]
    # where each backward input comes from: outside, a saved activation, the head
    src = []
    for i, v in enumerate(B.inputs):
        if i in b_in:
            src.append(("ext", i))
        elif v in ys_f:
            src.append(("res", ys_f.index(v)))
        else:
            src.append(("head", v))
    res_ys = sorted({j for kind, j in src if kind == "res"})
    head_ext = [(v, lab) for v, lab in fused.head_ins if v not in F.outputs]
    head_vals = {v for kind, v in src if kind == "head"} | {v for v, _ in fused.head_outs}
    kept_carry = [j for j, v in enumerate(f_outs[: fw.n_k]) if v in keep]
    # per-layer results of the forward loop the rest of the step reads (an NNX dropout
    # layer's rng count): folded over the micro-batches as GPipe folds them
    kept_ys = [j for j, v in enumerate(ys_f) if v in keep]
    b_ext = sorted(b_in)
    n_f, n_b = len(f_in), len(b_ext)

    def head(fc, hx, mc):
        env = dict(zip(f_outs[: fw.n_k], fc)) | dict(zip((v for v, _ in head_ext), hx))
        env = run_head(env, mc)
        return {v: env[v] for v in sorted(head_vals)}

    def staged(*args):
        fargs, bargs, hargs = args[:n_f], args[n_f : n_f + n_b], args[n_f + n_b :]
        s = jax.lax.axis_index(axis)
        if V > 1:  # each per-layer input in chunk order, once per value (module doc)
            moved = {}
            for loop, ins, vals in ((fw, range(n_f), F.inputs), (bw, b_ext, B.inputs)):
                for i in ins:
                    if loop.is_x[i] and i not in loop.fills and vals[i] not in moved:
                        x = fargs[i] if loop is fw else bargs[b_ext.index(i)]
                        moved[vals[i]] = x if vals[i] in resident else to_chunks(x, axis, S, V)
            fargs = [moved.get(x, a) for x, a in zip(F.inputs, fargs)]
            bargs = [moved.get(B.inputs[i], a) for i, a in zip(b_ext, bargs)]
            my_slots = jnp.asarray(slot_table, dtype=jnp.int32)[s]  # this stage's row
        bargs = dict(zip(b_ext, bargs))
        first = lambda c: True if c is None else c == 0  # noqa: E731
        last = lambda c: True if c is None else c == V - 1  # noqa: E731

        def ring(mc, c):
            """The saved-activation slot of micro-batch `mc` (interleaved: through chunk
            `c`, forward pass `j`; `interleaved_slots`)."""
            if c is None:
                return mc % R
            return my_slots[interleaved_number(mc, c, S, V)]

        def f_in(st, m, c=None):
            """The forward pass of micro-batch `m` (idle outside 0..M-1; interleaved:
            through chunk `c`): (whether it is on, its index clipped, its inputs, its
            carry in)."""
            on, mc = (m >= 0) & (m < M), jnp.clip(m, 0, M - 1)
            init = fw.init(fargs, mc)
            fc = [jnp.where((s == 0) & first(c), x, y) for x, y in zip(init, st["fc"])]
            return on, mc, [fw.pick(i, a, mc, c) for i, a in enumerate(fargs)], fc

        def f_keep(st, on, mc, fc, fy, c=None):
            """The forward pass's results kept: saved activations, the last stage's
            carry where the step reads it, the carry to pass on."""
            st["res"] = [
                _pin(jnp.where(on, r.at[ring(mc, c)].set(fy[j]), r), fw.y_pspec(j, 2))
                for r, j in zip(st["res"], res_ys)
            ]
            on_last = on & (s == S - 1) & last(c)
            st["fout"] = _collect(st["fout"], [fc[j] for j in kept_carry], mc, on_last)
            fys = [fy[j] for j in kept_ys]
            st["fys"] = fw.accumulate(st["fys"], fys, mc, on, c, only=kept_ys)
            st["fc"] = fc

        def forward(st, m, c=None):
            """Micro-batch `m` (idle outside 0..M-1) through this stage's layers (chunk
            `c`'s)."""
            on, mc, xs, fc = f_in(st, m, c)
            fc, fy = fw.run(xs, fc, mc, chunk=c is not None)
            f_keep(st, on, mc, fc, fy, c)
            return fc, mc

        def turn(st, fc, mc, on=True):
            """The head of micro-batch `mc` (the last stage's, where `on`): its values
            for the backward loop; its outputs summed or stored."""
            hx = [_at(x, lab, mc, False) for x, (_, lab) in zip(hargs, head_ext)]
            hv = head(fc, hx, mc)
            last = (s == S - 1) & on
            st["hacc"] = {
                v: (
                    a + jnp.where(last, hv[v], 0)
                    if lab == SUM
                    else jnp.where(last, a.at[mc].set(hv[v]), a)
                )
                for (v, lab), a in zip(fused.head_outs, st["hacc"].values())
            }
            return hv

        def b_in(st, m, hv, c=None):
            """The backward pass of micro-batch `m` (idle outside 0..M-1; interleaved:
            through chunk `c`); `hv`: the head's values (the last stage's), None where
            none was run: (whether it is on, its index clipped, its inputs, its carry in)."""
            on, mc = (m >= 0) & (m < M), jnp.clip(m, 0, M - 1)
            picked, init = b_pick(st, mc, hv, c)
            here = (s == S - 1) & last(c)
            return on, mc, picked, [jnp.where(here, x, y) for x, y in zip(init, st["bc"])]

        def b_pick(st, mc, hv, c=None):
            """The backward loop's inputs at micro-batch `mc`, and its carry's among them."""
            picked, init = [], []
            for i, (kind, x) in enumerate(src):
                if kind == "ext":
                    picked.append(bw.pick(i, bargs[x], mc, c))
                elif kind == "res":
                    picked.append(st["res"][res_ys.index(x)][ring(mc, c)])
                else:  # the head's value: none in the ramp down, where it is unused
                    zero = jnp.zeros_like(bw.carry0()[i - bw.n_c])
                    picked.append(zero if hv is None else hv[x])
                if bw.n_c <= i < bw.n_c + bw.n_k:
                    init.append(picked[-1])
            return picked, init

        def b_keep(st, on, mc, bc, by, c=None):
            st["bys"] = bw.accumulate(st["bys"], by, mc, on, c)
            st["bout"] = _collect(st["bout"], bc, mc, on & (s == 0) & first(c))
            st["bc"] = bc

        def backward(st, m, hv, c=None):
            on, mc, xs, bc = b_in(st, m, hv, c)
            bc, by = bw.run(xs, bc, mc, chunk=c is not None)
            b_keep(st, on, mc, bc, by, c)

        def input_grads(st, m, hv):
            """Zero-bubble: the backward pass of micro-batch `m` up to its input
            gradient (the carry to pass on); what its weight gradients read is kept."""
            on, mc, xs, bc = b_in(st, m, hv)
            bc, bnd = bw.run_b(xs, bc, mc)
            st["bnd"] = [jnp.where(on, b.at[mc % Q].set(x), b) for b, x in zip(st["bnd"], bnd)]
            st["bout"] = _collect(st["bout"], bc, mc, on & (s == 0))
            st["bc"] = bc

        def weight_grads(st, m):
            """Zero-bubble: the weight gradients of micro-batch `m` (idle outside 0..M-1),
            from its inputs and what its `input_grads` kept."""
            on, mc = (m >= 0) & (m < M), jnp.clip(m, 0, M - 1)
            xs, _ = b_pick(st, mc, None)
            by = bw.run_w(xs, [b[mc % Q] for b in st["bnd"]], mc)
            st["bys"] = bw.accumulate(st["bys"], by, mc, on)

        st = {
            "fc": fw.carry0(),
            "bc": bw.carry0(),
            "res": [
                jnp.zeros((R, fw.kc, *fw.y_types[j].shape), fw.y_types[j].dtype) for j in res_ys
            ],
            "fout": [o for j, o in enumerate(fw.out0()) if j in kept_carry],
            "fys": fw.ys0(kept_ys),
            "hacc": {v: _head_buffer(v, lab, fused, M) for v, lab in fused.head_outs},
            "bout": bw.out0(),
            "bys": bw.ys0(),
        }
        if alternate:
            parts = (f_in, f_keep, b_in, b_keep, turn)
            st = slots.alternating(st, s, S, M, fw, bw, parts, branches(mesh))
        elif V > 1:
            st = slots.interleaved(st, s, S, M, V, fw, bw, forward, turn, backward)
        elif zero_bubble:
            st["bnd"] = bw.boundary0(Q)
            st = slots.zero_bubble(st, s, S, M, fw, bw, forward, turn, input_grads, weight_grads)
        else:
            st = slots.lock_step(st, s, S, M, fw, bw, forward, turn, backward)
        total = lambda xs: summed(xs, axis, mesh)  # noqa: E731
        back = lambda v, y: y if v in resident else from_chunks(y, axis, S, V)  # noqa: E731
        bys = [back(v, y) for v, y in zip(B.outputs[bw.n_k :], st["bys"])]
        fys = [back(ys_f[j], y) for j, y in zip(kept_ys, st["fys"])]
        return (
            *total(st["fout"]),
            *total(st["hacc"].values()),
            *total(st["bout"]),
            *bys,
            *fys,
        )

    n_h = len(fused.head_outs)
    in_specs = (
        *(fw.spec(i) for i in range(n_f)),
        *(bw.spec(i) for i in b_ext),
        *(PartitionSpec() for _ in head_ext),
    )
    out_specs = (PartitionSpec(),) * (len(kept_carry) + n_h + bw.n_k) + (PartitionSpec(axis),) * (
        len(bw.y_labels) + len(kept_ys)
    )
    f = jax.shard_map(
        staged,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={axis},
        check_vma=False,
    )
    args = [
        *(fw.staged(i, x) for i, x in enumerate(f_in)),
        *(bw.staged(i, b_in[i]) for i in b_ext),
        *(x if lab == SAME else cut(x, lab, M) for x, (_, lab) in zip(h_in, head_ext)),
    ]
    results = list(f(*args))
    fout, results = results[: len(kept_carry)], results[len(kept_carry) :]
    hacc, results = results[:n_h], results[n_h:]
    bout, results = results[: bw.n_k], results[bw.n_k :]
    bys, fys = results[: len(bw.y_labels)], results[len(bw.y_labels) :]
    f_results: list = [None] * len(f_outs)
    for j, c in zip(kept_carry, fout):
        f_results[j] = uncut(c, fw.labels.outs[j])
    for j, y in zip(kept_ys, fw.finish_ys(fys, only=kept_ys)):
        f_results[fw.n_k + j] = y
    heads = {v: a if lab == SUM else uncut(a, lab) for (v, lab), a in zip(fused.head_outs, hacc)}
    return f_results, [*bw.finish_carry(bout), *bw.finish_ys(bys)], heads


def _head_buffer(v: int, lab: Label, fused: Fused, M: int):
    t = fused.micro_types[v]
    return jnp.zeros(t.shape if lab == SUM else (M, *t.shape), t.dtype)


def _accumulate(buf, y, lab: Label, mc, active):
    """Fold micro-batch `mc`'s per-layer output `y` [k, ...] into its buffer."""
    if lab == SUM:
        return buf + jnp.where(active, y, jnp.zeros_like(y))
    if lab == SAME:
        return jnp.where(active, y, buf)
    return jnp.where(active, buf.at[:, mc].set(y), buf)
