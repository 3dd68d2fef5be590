"""autopar: automatic parallelization for JAX.

Trace a function, search a sharding for every op with a cost model, run it as
`jax.jit` with those shardings.
"""

from autopar.api import Parallelized, make_mesh, parallelize
from autopar.errors import AutoparError, CaptureError, MemoryBudgetError, MeshError, PlanError
from autopar.plan import Plan

__all__ = [
    "AutoparError",
    "CaptureError",
    "MemoryBudgetError",
    "MeshError",
    "Parallelized",
    "Plan",
    "PlanError",
    "make_mesh",
    "parallelize",
]
