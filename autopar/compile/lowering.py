"""A plan's `jax.jit` lowered for the arguments it was made for, and the memory XLA
compiles it to: what the compile check (`compile.driver`) and `Parallelized.lower`
use."""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, NamedSharding

from autopar.ir.capture import abstractify_tree
from autopar.plan.plan import Plan
from autopar.plan.records import TensorRecord


def compiled_memory(compiled) -> int:
    """Per-device bytes XLA needs: arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def info_str(plan: Plan) -> str:
    return f"{plan.engine} on {plan.mesh.shape}"


def lowered(jitted, flat_args, plan: Plan, mesh) -> jax.stages.Lowered:
    """`jitted` lowered for `flat_args` laid out as `plan` says (on an abstract mesh:
    traced and lowered for GPUs, without devices)."""
    flat = [_sds_for(x, r, mesh) for x, r in zip(flat_args, plan.inputs)]
    if isinstance(mesh, AbstractMesh):
        return jitted.trace(*flat).lower(lowering_platforms=("cuda",))
    return jitted.lower(*flat)


def _sds_for(x, rec: TensorRecord, mesh):
    a = abstractify_tree(x)
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, rec.spec.to_pspec())
        )
    return a
