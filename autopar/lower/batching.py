"""Gathers and scatters with batching dims, bound as their equivalents without them.

`jnp.take_along_axis` (the integer-label cross entropy of optax and of most training
code) gathers with operand batching dims, and its gradient scatters with them. Inside
a pipeline's stage region (a `shard_map` manual over the stage axis, automatic over
the others) XLA:CPU's SPMD partitioner aborts the process on such a gather
(`spmd_partitioner_util.cc:497`, `partition_group_list.num_replica_groups() * ... ==
device_groups.num_devices_per_group()`) where the same loss written with explicit
`arange` indices compiles (a GPT-2-style decoder on `{"stage": 2, "data": 2, "model":
2}`, benchmarks/discussion.md, session 36). So the lowering binds such an op in a
manual region as the same op with each batching dim made an ordinary indexed dim:
its index is an iota over the indices' batch dim, its slice collapsed (gather) or
inserted (scatter). Every element reads or writes the same operand element as
before; the indices' other components, and so the op's mode, are untouched.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autopar.ir.graph import Node

__all__ = ["unbatched"]


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
