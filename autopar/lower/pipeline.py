"""A pipelined scan: GPipe or 1F1B over the mesh's stage axis, inside one jitted program.

The loop's per-layer inputs (`xs`: weights, saved activations) and outputs (`ys`) are
split over the stage axis along the layer dim, so stage `s` holds layers
`[s k, (s + 1) k)`. The rest is replicated over that axis. In `shard_map`, manual over
the stage axis only (the data/model axes stay with XLA's partitioner and the body's
own plan), the program runs in lock-step slots; in a forward slot `i` stage `s` runs
micro-batch `i - s` through its `k` layers (a `lax.scan` of the micro-batch body) and
passes the carry on with `ppermute` (a collective-permute); a reversed loop (a
backward pass) runs from the last stage to the first. A stage with no micro-batch in a
slot (the pipeline filling or draining) computes on zeros and drops the result: it
would wait anyway. (`lax.cond` could skip it, but XLA:CPU deadlocks on collectives in
branches that only some devices take.)

GPipe (`run_gpipe`): `M + S - 1` forward slots, then as a separate pipeline
`M + S - 1` backward ones; each stage keeps all `M` micro-batches' saved activations
in between. 1F1B (`run_1f1b`): the forward loop, the head between the loops (loss
and its gradient, per micro-batch, on the last stage) and the backward loop in one
pipeline of `S - 1` forward slots, then `M` ticks of a forward slot, the head and a
backward slot, then `S - 1` backward slots. The critical path is the same
`(M + S - 1)` forward and backward slots as GPipe's (plus `M` heads), but stage `s`
frees a micro-batch's activations `2 (S - 1 - s)` slots after saving them, so it holds
at most `2S - 1` micro-batches' worth whatever `M` is.

Micro-batch `m` of a batched value is the strided slice `m::M` of its batch dim, so a
batch dim sharded over `data` stays sharded the same way in every micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from autopar.ir.graph import Graph, Node
from autopar.passes.microbatch import cut, uncut
from autopar.passes.pipeline import SAME, SUM, Fused, Label, ScanLabels


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
        self, node: Node, micro_body: Graph, labels: ScanLabels, run_body, pipe, mesh, out_specs
    ):
        p = node.params
        self.node, self.labels, self.run_body, self.pipe = node, labels, run_body, pipe
        self.n_c, self.n_k, self.reverse = p["num_consts"], p["num_carry"], p["reverse"]
        self.k = p["length"] // pipe.stages
        self.is_x = [i >= self.n_c + self.n_k for i in range(len(node.inputs))]
        outs = micro_body.outputs
        # a Partial output is stacked: one summand per device of its partial axes
        self.stacks = [
            (math.prod(mesh.shape[a] for a in sp.partial),) if sp.partial else ()
            for sp in out_specs[self.n_k :]
        ]
        self.y_labels = labels.outs[self.n_k :]
        self.y_types = [micro_body.values[v] for v in outs[self.n_k :]]
        self.carry_types = [micro_body.values[v] for v in outs[: self.n_k]]

    def staged(self, i: int, x):
        """Input `i` with micro-batches stacked in front (consts, carry) or after the
        layer dim (xs)."""
        lab, xs = self.labels.ins[i], int(self.is_x[i])
        return x if lab == SAME else cut(x, lab + xs, self.pipe.microbatches, lead=xs)

    def spec(self, i: int) -> PartitionSpec:
        return PartitionSpec(self.pipe.axis) if self.is_x[i] else PartitionSpec()

    def pick(self, i: int, x, mc):
        return _at(x, self.labels.ins[i], mc, self.is_x[i])

    def pos(self, s):
        return self.pipe.stages - 1 - s if self.reverse else s

    def init(self, args, mc) -> list:
        return [jnp.asarray(a)[mc] for a in args[self.n_c : self.n_c + self.n_k]]

    def run(self, args, carry) -> tuple[list, list]:
        """One micro-batch through this stage's layers; `args` are its inputs picked at
        that micro-batch (`xs` with the stage's `k` layers in front)."""
        consts, xs = args[: self.n_c], args[self.n_c + self.n_k :]

        def layer(c, x):
            outs = self.run_body(*consts, *c, *x)
            return list(outs[: self.n_k]), list(outs[self.n_k :])

        return jax.lax.scan(layer, list(carry), list(xs), length=self.k, reverse=self.reverse)

    def carry0(self) -> list:
        return [jnp.zeros(t.shape, t.dtype) for t in self.carry_types]

    def out0(self) -> list:
        return [jnp.zeros((self.pipe.microbatches, *t.shape), t.dtype) for t in self.carry_types]

    def ys0(self) -> list:
        M, k = self.pipe.microbatches, self.k
        return [
            jnp.zeros((k, *stack, *t.shape) if lab in (SUM, SAME) else (k, M, *t.shape), t.dtype)
            for t, lab, stack in zip(self.y_types, self.y_labels, self.stacks)
        ]

    def accumulate(self, ys, y, mc, active) -> list:
        return [_accumulate(b, v, lab, mc, active) for b, v, lab in zip(ys, y, self.y_labels)]

    def hop(self, carry) -> list:
        S, step = self.pipe.stages, -1 if self.reverse else 1
        perm = [(i, i + step) for i in range(S) if 0 <= i + step < S]
        return [jax.lax.ppermute(c, self.pipe.axis, perm) for c in carry]

    def finish_carry(self, out) -> list:
        return [uncut(c, lab) for c, lab in zip(out, self.labels.outs[: self.n_k])]

    def finish_ys(self, ys) -> list:
        return [
            (jnp.moveaxis(y, 1, 0) if stack else y)
            if lab in (SUM, SAME)
            else uncut(y, lab + 1, lead=1)
            for y, lab, stack in zip(ys, self.y_labels, self.stacks)
        ]


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
            carry, y = loop.run(picked, carry)
            ys = loop.accumulate(ys, y, mc, active)
            out = _collect(out, carry, mc, active & (pos == S - 1))
            return (loop.hop(carry), out, ys), None

        state = (loop.carry0(), loop.out0(), loop.ys0())
        (_, out, ys), _ = jax.lax.scan(tick, state, jnp.arange(M + S - 1))
        return (*[jax.lax.psum(o, axis) for o in out], *ys)

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
    run_head: Callable[[dict], dict],
    mesh,
    f_in: Sequence,
    b_in: Mapping[int, object],
    h_in: Sequence,
    keep: frozenset[int],
) -> tuple[list, list, dict]:
    """The forward loop, the head and the backward loop of `fused` as one 1F1B
    pipeline. `f_in`: the forward loop's inputs; `b_in`: the backward loop's inputs
    from outside the region, by position; `h_in`: the values of `fused.head_ins` not
    made by the forward loop; `keep`: the forward loop's outputs the rest of the step
    reads. Returns the forward loop's outputs (None where not kept), the backward
    loop's, and the head's `head_outs` by value id."""
    pipe = fw.pipe
    S, M, axis = pipe.stages, pipe.microbatches, pipe.axis
    F, B = fw.node, bw.node
    R = min(M, 2 * S - 1)  # saved activations held per stage
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
    b_ext = sorted(b_in)
    n_f, n_b = len(f_in), len(b_ext)

    def head(fc, hx):
        env = dict(zip(f_outs[: fw.n_k], fc)) | dict(zip((v for v, _ in head_ext), hx))
        env = run_head(env)
        return {v: env[v] for v in sorted(head_vals)}

    def staged(*args):
        fargs, bargs, hargs = args[:n_f], args[n_f : n_f + n_b], args[n_f + n_b :]
        s = jax.lax.axis_index(axis)
        bargs = dict(zip(b_ext, bargs))

        def forward(st, slot):
            """Forward `slot`: micro-batch slot - s through this stage's layers."""
            m = slot - s
            on, mc = (m >= 0) & (m < M), jnp.clip(m, 0, M - 1)
            fc = [jnp.where(s == 0, x, c) for x, c in zip(fw.init(fargs, mc), st["fc"])]
            fc, fy = fw.run([fw.pick(i, a, mc) for i, a in enumerate(fargs)], fc)
            st["res"] = [
                jnp.where(on, r.at[mc % R].set(fy[j]), r) for r, j in zip(st["res"], res_ys)
            ]
            st["fout"] = _collect(st["fout"], [fc[j] for j in kept_carry], mc, on & (s == S - 1))
            st["fc"] = fw.hop(fc)
            return fc, mc

        def backward(st, slot, hv):
            """Backward `slot`: micro-batch slot - (S - 1 - s), from the last stage down."""
            m = slot - (S - 1 - s)
            on, mc = (m >= 0) & (m < M), jnp.clip(m, 0, M - 1)
            picked, init = [], []
            for i, (kind, x) in enumerate(src):
                if kind == "ext":
                    picked.append(bw.pick(i, bargs[x], mc))
                elif kind == "res":
                    picked.append(st["res"][res_ys.index(x)][mc % R])
                else:  # the head's value: none in the ramp down, where it is unused
                    zero = jnp.zeros_like(bw.carry0()[i - bw.n_c])
                    picked.append(zero if hv is None else hv[x])
                if bw.n_c <= i < bw.n_c + bw.n_k:
                    init.append(picked[-1])
            bc = [jnp.where(s == S - 1, x, c) for x, c in zip(init, st["bc"])]
            bc, by = bw.run(picked, bc)
            st["bys"] = bw.accumulate(st["bys"], by, mc, on)
            st["bout"] = _collect(st["bout"], bc, mc, on & (s == 0))
            st["bc"] = bw.hop(bc)

        def warm(st, slot):
            forward(st, slot)
            return st, None

        def steady(st, k):
            # forward slot S - 1 + k brings micro-batch k to the end of the last stage,
            # whose head turns it around for backward slot k
            fc, mc = forward(st, S - 1 + k)
            hx = [_at(x, lab, mc, False) for x, (_, lab) in zip(hargs, head_ext)]
            hv = head(fc, hx)
            last = s == S - 1
            st["hacc"] = {
                v: (
                    a + jnp.where(last, hv[v], 0)
                    if lab == SUM
                    else jnp.where(last, a.at[mc].set(hv[v]), a)
                )
                for (v, lab), a in zip(fused.head_outs, st["hacc"].values())
            }
            backward(st, k, hv)
            return st, None

        def cool(st, slot):
            backward(st, slot, None)
            return st, None

        st = {
            "fc": fw.carry0(),
            "bc": bw.carry0(),
            "res": [
                jnp.zeros((R, fw.k, *fw.y_types[j].shape), fw.y_types[j].dtype) for j in res_ys
            ],
            "fout": [o for j, o in enumerate(fw.out0()) if j in kept_carry],
            "hacc": {v: _head_buffer(v, lab, fused, M) for v, lab in fused.head_outs},
            "bout": bw.out0(),
            "bys": bw.ys0(),
        }
        st, _ = jax.lax.scan(warm, st, jnp.arange(S - 1))
        st, _ = jax.lax.scan(steady, st, jnp.arange(M))
        st, _ = jax.lax.scan(cool, st, jnp.arange(M, M + S - 1))
        total = lambda xs: [jax.lax.psum(x, axis) for x in xs]
        return (*total(st["fout"]), *total(st["hacc"].values()), *total(st["bout"]), *st["bys"])

    n_h = len(fused.head_outs)
    in_specs = (
        *(fw.spec(i) for i in range(n_f)),
        *(bw.spec(i) for i in b_ext),
        *(PartitionSpec() for _ in head_ext),
    )
    out_specs = (PartitionSpec(),) * (len(kept_carry) + n_h + bw.n_k) + (
        PartitionSpec(axis),
    ) * len(bw.y_labels)
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
    bout, bys = results[: bw.n_k], results[bw.n_k :]
    f_results: list = [None] * len(f_outs)
    for j, c in zip(kept_carry, fout):
        f_results[j] = uncut(c, fw.labels.outs[j])
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
