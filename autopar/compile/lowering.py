"""A plan's `jax.jit` lowered for the arguments it was made for, and the memory XLA
compiles it to: what the compile check (`compile.driver`) and `Parallelized.lower`
use."""

from __future__ import annotations

import warnings
from dataclasses import replace

import jax
from jax.sharding import AbstractMesh, NamedSharding

from autopar.errors import format_bytes, user_level
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


def first_call_memory(jitted, args, plan: Plan, budget: float, name: str) -> Plan:
    """`plan` with the memory XLA compiled `jitted` to for `args` (its first call's own
    compile: jit's cache keeps the executable for the call itself) and, where that is
    over `budget`, a warning: a plan predicted below the compile check's fraction of the
    budget is not compiled during the search (`compile.driver`), so the prediction alone
    vouched for it."""
    got = jitted.lower(*args).compile()
    if got.memory_analysis() is None:  # (a backend without the analysis)
        return plan
    need = compiled_memory(got)
    plan = replace(plan, compiled_memory_bytes=need)
    if need <= budget:
        return plan
    peak = plan.cost.peak_memory_bytes
    why = (
        f"the compiled program needs {format_bytes(need)} per device, over the memory budget "
        f"of {format_bytes(budget)}: the plan was predicted at {format_bytes(peak)} (XLA's own "
        "temporaries and copies come on top) and, that far under the budget, not compiled "
        f"during the search. A memory_budget near {format_bytes(budget * peak / need)} makes "
        "the search hold the difference back (it then compile-checks plans near it), or "
        "remat='auto' recomputes where that is the fastest way to fit"
    )
    warnings.warn(f"autopar: {name}: {why}", stacklevel=user_level())
    return replace(plan, warnings=(*plan.warnings, why))
