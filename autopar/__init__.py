"""autopar: automatic parallelization for JAX.

Trace a function, search a sharding for every op with a cost model, run it as
`jax.jit` with those shardings.
"""

from autopar import checkpoint, distributed
from autopar.api import Parallelized, parallelize
from autopar.errors import (
    AutoparError,
    CaptureError,
    MemoryBudgetError,
    MeshError,
    MicrobatchError,
    PipelineError,
    PlanError,
)
from autopar.meshes import make_mesh
from autopar.plan.plan import Plan
from autopar.tools.workload import Workload

__all__ = [
    "AutoparError",
    "CaptureError",
    "MemoryBudgetError",
    "MeshError",
    "MicrobatchError",
    "Parallelized",
    "PipelineError",
    "Plan",
    "PlanError",
    "Workload",
    "checkpoint",
    "distributed",
    "make_mesh",
    "parallelize",
]
