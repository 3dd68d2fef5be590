"""What one call of a parallelized function is to the driver: the options `parallelize`
was given (`Options`), the call's arguments (`Call`) and the plan and program made for
its argument signature (`Compiled`, what `api.Parallelized` caches)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

import cost_models
from autopar.compile.lowering import first_call_memory
from autopar.ir.graph import Graph
from autopar.passes.roll import Roll
from autopar.plan.plan import Plan
from autopar.search.problem import Problem


@dataclass(frozen=True)
class Options:
    """What `parallelize` was asked, validated once (`api.Parallelized`)."""

    fn: Callable
    keywords: tuple[str, ...]  # keyword-only parameters, traced after the positional ones
    profile: cost_models.ClusterProfile
    meshes: tuple[Mesh | AbstractMesh, ...]  # one, or the candidates of mesh search
    engine: str
    memory_budget: float
    static_argnums: tuple[int, ...]
    donate_argnums: tuple[int, ...]
    in_specs: Any
    allow_partial: bool
    pipeline_stages: int | str | None
    microbatches: int | None
    pipeline_schedule: str | None
    virtual_stages: int  # chunks of layers per stage (the interleaved schedule), else 1
    given_plan: Plan | None
    precision: str | None
    grad_accumulation: int | None
    remat: str | None
    time_limit: float | None = None  # seconds; then the best plan found so far
    cache_dir: Any = None  # the plan cache's directory (`compile.cache`), or None: off
    progress: bool = True  # `compile.progress` around every search (`api.Parallelized`)


@dataclass(frozen=True)
class Call:
    """One call's arguments as the driver reads them (`api.Parallelized` binds them)."""

    args: tuple  # positional, then the keyword-only ones
    static: tuple[int, ...]  # positions of the static ones
    donate: tuple[int, ...]  # flat positions of the donated leaves
    in_specs: Any  # `in_specs=` for every non-static argument, or None

    @property
    def dyn(self) -> tuple:
        return tuple(a for i, a in enumerate(self.args) if i not in self.static)

    @property
    def flat(self) -> list:
        return jax.tree_util.tree_leaves(self.dyn)


@dataclass
class Compiled:
    """One argument signature's plan and program: what `Parallelized` caches."""

    graph: Graph
    plan: Plan
    problem: Problem | None
    jitted: Any
    mesh: Mesh | AbstractMesh
    # some option (mesh shape, pipeline, engine) was turned away or reshaped by the
    # memory budget: more rematerialization might let a faster one fit
    memory_bound: bool = False
    # `graph` is the user's step with its unrolled layers rolled into loops: how its
    # inputs and outputs stand for the user's leaves (`autopar.lower.rolled`)
    roll: Roll | None = None
    io: Any = None  # its `autopar.lower.rolled.RolledIO`, made on the first call
    ran: bool = False  # called once: XLA's memory for it is in the plan
    # the function as traced for it, the hash of its call's options (`cache.described_key`)
    # and of that trace's program (`cache.program_hash`, made when a later call asks):
    # a later call that traces to the same program takes its plan (`compile.step`)
    traced: Graph | None = None
    described: str = ""
    program: str | None = None

    def run(self, args: list, budget: float, name: str) -> Any:
        """The program on `args` (laid out as the plan says); the first call sees what XLA
        compiled it to and warns where that is over `budget` (`first_call_memory`)."""
        if not self.ran:
            self.plan = first_call_memory(self.jitted, args, self.plan, budget, name)
            self.ran = True
        return self.jitted(*args)

    @property
    def step_s(self) -> float:
        return self.plan.cost.step_s

    @property
    def remat(self) -> str | None:
        return self.plan.remat


@dataclass(frozen=True)
class Proxy:
    """A remat policy's fastest plan as priced on the unrolled stack rolled into one
    loop over all its layers (`compile.pipelines.proxied`), before any plan is made:
    `realize()` rolls that try into loops over its stages, searches it again and gives
    the `Compiled` that runs (or the `Infeasible` saying why none fits)."""

    step_s: float
    memory_bound: bool
    remat: str | None
    realize: Callable[[], Any]


@dataclass(frozen=True)
class OneLoop:
    """A try without a pipeline (`pipeline_stages="auto"`, a mesh with no stage axis) on
    a step whose layers are unrolled in Python, priced on `graph`, the stack rolled into
    one loop over all its layers (`roll`), as the pipeline tries are: its search is the
    scanned model's, flat in depth. Where it is the plan, it is searched again on the
    step as it runs (`compile.pipelines.PipelineTries._realized`)."""

    graph: Graph
    roll: Roll


def pipeline_of(pipelined: Any) -> Any:
    """A try's pipeline (`PipelinedScans`), None for a try without one (`OneLoop`)."""
    return None if isinstance(pipelined, OneLoop) else pipelined
