"""Gathers and scatters with batching dims, bound without them in a pipeline's stages.

`jnp.take_along_axis` (the integer-label cross entropy of optax and of most training
code) gathers with operand batching dims, and its gradient scatters with them. Inside
a pipeline's stage region (a `shard_map` manual over the stage axis, automatic over
the others) XLA:CPU's SPMD partitioner aborts the process on such a gather
(`spmd_partitioner_util.cc:497`, `partition_group_list.num_replica_groups() * ... ==
device_groups.num_devices_per_group()`) where the same loss written with explicit
`arange` indices compiles (a GPT-2-style decoder on `{"stage": 2, "data": 2, "model":
2}`, benchmarks/discussion.md, session 36). Written with those `arange` indices, the
gather aborted in turn on a BERT-style classifier's loss (labels `[B]`, 4
micro-batches of 2 on the same mesh; session 42), as did a minimal `shard_map` with
the gather's result split over `data`; the loss written with a one-hot mask (optax's
`softmax_cross_entropy`) compiled in every case tried. So the lowering binds, in a
manual region:

* a gather or scatter-add that takes (adds) one element per row along one dim, all
  other operand dims batching (`take_along_axis` and its gradient): as a masked sum
  over that dim (`taken`): each position compares its index with an iota along the
  dim and sums the one element it selects (a select, never a product, so no `inf`
  or NaN elsewhere in the row leaks in): the gather exactly, the scatter-add up to the
  order in which several updates of one element add up; out-of-bounds indices as the
  op's mode says (clamped, or the gather's fill value and the scatter's dropped update);
* any other op with batching dims as the same op with each batching dim made an
  ordinary indexed dim (`unbatched`): its index is an iota over the indices' batch
  dim, its slice collapsed (gather) or inserted (scatter). Every element reads or
  writes the same operand element as before; the indices' other components, and so
  the op's mode, are untouched.

The plan prices the gather; the masked sum reads the operand once more (a row's
elements, not one), a pass the softmax beside it makes several times.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autopar.ir.graph import Node

__all__ = ["taken", "unbatched"]


def _with_iotas(indices: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    """`indices` (the index vector in its last dim) with, first in the vector, the
    position along each of `dims` (its batching dims)."""
    shape = indices.shape[:-1] + (1,)
    if any(indices.shape[d] > jnp.iinfo(indices.dtype).max for d in dims):
        indices = indices.astype(jnp.int32)  # narrow indices could not hold the positions
    iotas = [lax.broadcasted_iota(indices.dtype, shape, d) for d in dims]
    return jnp.concatenate([*iotas, indices], axis=-1)


# Per op kind, the fields of its dimension numbers that name the operand dims an index
# collapses (gather) or inserts (scatter), the operand dims the index vector's entries
# address, and the indices' batching dims.
_FIELDS = {
    "gather": ("collapsed_slice_dims", "start_index_map", "start_indices_batching_dims"),
    "scatter": (
        "inserted_window_dims",
        "scatter_dims_to_operand_dims",
        "scatter_indices_batching_dims",
    ),
}


def unbatched(node: Node, invals: list[Any], params: dict) -> tuple[list[Any], dict] | None:
    """(operands, params) binding `node` (a gather or a scatter with batching dims) as
    the same op without them; None for any other node."""
    kind = "scatter" if node.op.startswith("scatter") else node.op
    dn = params.get("dimension_numbers")
    if kind not in _FIELDS or not getattr(dn, "operand_batching_dims", ()):
        return None
    collapsed, addressed, batching = _FIELDS[kind]
    new = dn._replace(
        **{
            collapsed: tuple(sorted(getattr(dn, collapsed) + dn.operand_batching_dims)),
            addressed: dn.operand_batching_dims + getattr(dn, addressed),
            "operand_batching_dims": (),
            batching: (),
        }
    )
    operand, indices, *updates = invals
    indices = _with_iotas(indices, getattr(dn, batching))
    return [operand, indices, *updates], _flags_off({**params, "dimension_numbers": new})


def _flags_off(params: dict) -> dict:
    """The promises about the indices (sorted, unique) dropped: they held per batch."""
    return {**params, "indices_are_sorted": False, "unique_indices": False}


def taken(node: Node, invals: list[Any], params: dict) -> list[Any] | None:
    """The results of `node` when it is a gather (scatter-add) that takes (adds) one
    element per row along one operand dim, every other operand dim batching, computed
    as a masked sum over that dim (module doc); None for any other node."""
    dn = params.get("dimension_numbers")
    if node.op not in ("gather", "scatter-add") or not getattr(dn, "operand_batching_dims", ()):
        return None
    operand, indices, *updates = invals
    if node.op == "gather" and any(s != 1 for s in params["slice_sizes"]):
        return None
    collapsed, addressed, batching = _FIELDS["gather" if node.op == "gather" else "scatter"]
    axes, dropped, paired = getattr(dn, addressed), getattr(dn, collapsed), getattr(dn, batching)
    window = dn.offset_dims if node.op == "gather" else dn.update_window_dims
    dims = sorted((*dn.operand_batching_dims, *axes))
    numeric = jnp.issubdtype(operand.dtype, jnp.number)
    if (
        len(axes) != 1
        or window
        or tuple(dropped) != tuple(axes)
        or dims != list(range(operand.ndim))
        or not numeric
    ):
        return None
    a, n = axes[0], operand.shape[axes[0]]
    fill = params["mode"] == lax.GatherScatterMode.FILL_OR_DROP
    idx = indices[..., 0]  # the index vector is the indices' last dim, one entry long
    if not fill:  # clip, and XLA's own reading of a promise: clamped
        idx = jnp.clip(idx, 0, n - 1)
    # the operand's batching dims in the order of the index dims they pair with, then `a`
    pairs = sorted(zip(paired, dn.operand_batching_dims))
    perm = [d for _, d in pairs] + [a]
    shape = (*idx.shape, n)
    hit = lax.broadcasted_iota(idx.dtype, shape, idx.ndim) == idx[..., None]
    if node.op == "gather":
        rows = lax.broadcast_in_dim(
            jnp.transpose(operand, perm), shape, (*(i for i, _ in pairs), idx.ndim)
        )
        out = jnp.sum(jnp.where(hit, rows, 0), axis=-1, dtype=operand.dtype)
        if fill:  # `lax.gather` binds its fill value for the dtype
            value = jnp.asarray(params["fill_value"], operand.dtype)
            out = jnp.where((idx >= 0) & (idx < n), out, value)
        return [out]
    spread = jnp.where(hit, updates[0][..., None], 0)  # an out-of-bounds update hits nothing
    free = tuple(d for d in range(idx.ndim) if d not in paired)
    summed = jnp.sum(spread, axis=free, dtype=operand.dtype)  # batching dims, then `a`
    return [operand + jnp.transpose(summed, np.argsort(perm))]
