"""What a pipeline's staged program does differently on XLA:CPU devices (the tests'
simulated ones) than on GPUs: which form of the alternating schedule it runs, and how
it sums 16-bit floats over the stage axis."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def _on_cpu(mesh) -> bool:
    devices = getattr(mesh, "devices", None)  # None: an abstract mesh, lowered for GPUs
    return devices is not None and devices.flat[0].platform == "cpu"


# XLA:CPU runs the alternating schedule's passes as branches too (tests of the branch
# code on layers whose plan moves no data by collective-permute, see `slots.alternating`)
BRANCHES_ON_CPU = False


def summed(xs: Sequence, axis: str, mesh) -> list:
    """Each of `xs` summed over the stage axis (`psum`). On XLA:CPU devices a 16-bit
    float is summed in float32: inside a partly manual `shard_map`, JAX 0.10.2 puts a
    sharding constraint in the all-reduce's reducer, which XLA:CPU's bf16 all-reduce
    promotion cannot clone (it aborts the process: "Invalid binary instruction opcode
    copy")."""
    cpu = _on_cpu(mesh)
    wide = lambda x: cpu and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4  # noqa: E731
    return [
        jax.lax.psum(x.astype(jnp.float32), axis).astype(x.dtype)
        if wide(x)
        else jax.lax.psum(x, axis)
        for x in xs
    ]


def branches(mesh) -> bool:
    """Whether the alternating schedule runs each stage's pass as a branch: not on
    XLA:CPU devices (unless `BRANCHES_ON_CPU`)."""
    return BRANCHES_ON_CPU or not _on_cpu(mesh)
