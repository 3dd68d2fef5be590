"""A pipelined scan: GPipe over the mesh's stage axis, inside one jitted program.

The loop's per-layer inputs (`xs`: weights, saved activations) and outputs (`ys`) are
split over the stage axis along the layer dim, so stage `s` holds layers
`[s k, (s + 1) k)`. The rest is replicated over that axis. In `shard_map`, manual over
the stage axis only (the data/model axes stay with XLA's partitioner and the body's
own plan), the program ticks `M + S - 1` times; at tick `t` the stage at pipeline
position `p` runs micro-batch `m = t - p` through its `k` layers (a `lax.scan` of the
micro-batch body) and passes the carry on with `ppermute` (a collective-permute). A
reversed loop (a backward pass) runs from the last stage to the first.

Micro-batch `m` of a batched value is the strided slice `m::M` of its batch dim, so a
batch dim sharded over `data` stays sharded the same way in every micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from autopar.ir import Graph, Node
from autopar.pipeline import SAME, SUM, Label, Pipeline, ScanLabels
from autopar.sharding import Spec


def cut(x, dim: int, m: int, lead: int = 0):
    """[.., B, ..] -> micro-batches stacked at position `lead`: [.., M, .., B/M, ..]."""
    shape = x.shape
    x = x.reshape(*shape[:dim], shape[dim] // m, m, *shape[dim + 1 :])
    return jnp.moveaxis(x, dim + 1, lead)


def uncut(x, dim: int, lead: int = 0):
    """Inverse of `cut`: `dim` indexes the array once the micro-batch dim is removed."""
    x = jnp.moveaxis(x, lead, dim + 1)
    shape = x.shape
    return x.reshape(*shape[:dim], shape[dim] * shape[dim + 1], *shape[dim + 2 :])


def run_pipelined_scan(
    node: Node,
    micro_body: Graph,
    labels: ScanLabels,
    run_body: Callable,
    pipe: Pipeline,
    mesh,
    invals: Sequence,
    out_specs: Sequence[Spec],
) -> list:
    """The scan's outputs, computed by a GPipe pipeline over `pipe.axis`. `out_specs`
    are the body's output specs: a per-layer sum the body returns Partial (stacked, one
    summand per device) is accumulated over micro-batches as it is and comes out
    stacked, [devices, layers, ...], to be summed across devices once."""
    p = node.params
    n_c, n_k, length, reverse = p["num_consts"], p["num_carry"], p["length"], p["reverse"]
    S, M, axis = pipe.stages, pipe.microbatches, pipe.axis
    k = length // S
    n_in = len(invals)
    is_x = [i >= n_c + n_k for i in range(n_in)]
    # micro-batches stacked in front (consts, carry) or after the layer dim (xs)
    staged_in = [
        x if lab == SAME else cut(x, lab + xs, M, lead=xs)
        for x, lab, xs in zip(invals, labels.ins, map(int, is_x))
    ]
    outs_body = micro_body.outputs
    # a Partial output is stacked: one summand per device of its partial axes
    stacks = [
        (math.prod(mesh.shape[a] for a in sp.partial),) if sp.partial else ()
        for sp in out_specs[n_k:]
    ]
    y_labels = labels.outs[n_k:]
    y_types = [micro_body.values[v] for v in outs_body[n_k:]]
    carry_types = [micro_body.values[v] for v in outs_body[:n_k]]

    def at(x, lab: Label, mc, xs: bool):
        if lab == SAME:
            return x
        return jax.lax.dynamic_index_in_dim(x, mc, axis=int(xs), keepdims=False)

    def staged(*args):
        s = jax.lax.axis_index(axis)
        pos = S - 1 - s if reverse else s
        consts = args[:n_c]

        def layer(carry, x, mc):
            c = [at(v, lab, mc, False) for v, lab in zip(consts, labels.ins[:n_c])]
            outs = run_body(*c, *carry, *x)
            return list(outs[:n_k]), list(outs[n_k:])

        def tick(state, t):
            carry, out, ys = state
            m = t - pos
            active = (m >= 0) & (m < M)
            mc = jnp.clip(m, 0, M - 1)
            init = [jnp.asarray(a)[mc] for a in args[n_c : n_c + n_k]]
            carry = [jnp.where(pos == 0, i, c) for i, c in zip(init, carry)]
            xs = [
                at(x, lab, mc, True) for x, lab in zip(args[n_c + n_k :], labels.ins[n_c + n_k :])
            ]
            carry, y = jax.lax.scan(
                lambda c, x: layer(c, x, mc), carry, xs, length=k, reverse=reverse
            )
            ys = [_accumulate(b, v, lab, mc, active) for b, v, lab in zip(ys, y, y_labels)]
            last = active & (pos == S - 1)
            out = [jnp.where(last, o.at[mc].set(c), o) for o, c in zip(out, carry)]
            step = -1 if reverse else 1
            perm = [(i, i + step) for i in range(S) if 0 <= i + step < S]
            carry = [jax.lax.ppermute(c, axis, perm) for c in carry]
            return (carry, out, ys), None

        carry0 = [jnp.zeros(t.shape, t.dtype) for t in carry_types]
        out0 = [jnp.zeros((M, *t.shape), t.dtype) for t in carry_types]
        ys0 = [
            jnp.zeros((k, *stack, *t.shape) if lab in (SUM, SAME) else (k, M, *t.shape), t.dtype)
            for t, lab, stack in zip(y_types, y_labels, stacks)
        ]
        (_, out, ys), _ = jax.lax.scan(tick, (carry0, out0, ys0), jnp.arange(M + S - 1))
        out = [jax.lax.psum(o, axis) for o in out]
        return (*out, *ys)

    lifted = lambda xs: PartitionSpec(axis) if xs else PartitionSpec()
    f = jax.shard_map(
        staged,
        mesh=mesh,
        in_specs=tuple(lifted(x) for x in is_x),
        out_specs=tuple(PartitionSpec() for _ in range(n_k))
        + tuple(PartitionSpec(axis) for _ in y_labels),
        axis_names={axis},
        check_vma=False,
    )
    results = f(*staged_in)
    carry = [uncut(c, lab) for c, lab in zip(results[:n_k], labels.outs[:n_k])]
    ys = [
        (jnp.moveaxis(y, 1, 0) if stack else y) if lab in (SUM, SAME) else uncut(y, lab + 1, lead=1)
        for y, lab, stack in zip(results[n_k:], y_labels, stacks)
    ]
    return [*carry, *ys]


def _accumulate(buf, y, lab: Label, mc, active):
    """Fold micro-batch `mc`'s per-layer output `y` [k, ...] into its buffer."""
    if lab == SUM:
        return buf + jnp.where(active, y, jnp.zeros_like(y))
    if lab == SAME:
        return jnp.where(active, y, buf)
    return jnp.where(active, buf.at[:, mc].set(y), buf)
