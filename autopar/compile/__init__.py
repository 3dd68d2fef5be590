"""The compile layer: `driver` (the remat x mesh x pipeline tries for one call, the
re-captures for accumulation and pipelines, the compile check), `lowering` (a plan's
jit lowered for its arguments, XLA's memory figure) and `plans` (plans made from search
results, loaded plans bound to a trace)."""

from autopar.compile.calls import Call, Compiled, Options
from autopar.compile.driver import Infeasible
from autopar.compile.lowering import compiled_memory, info_str, lowered
from autopar.compile.plans import bind_plan, make_plan, plan_mismatch, reusable_specs, user_pins
from autopar.compile.step import compile_step

__all__ = [
    "Call",
    "Compiled",
    "Infeasible",
    "Options",
    "bind_plan",
    "compile_step",
    "compiled_memory",
    "info_str",
    "lowered",
    "make_plan",
    "plan_mismatch",
    "reusable_specs",
    "user_pins",
]
