"""Rows of a rolled layer group between layer order and the interleaved schedule's
chunk order: two primitives `autopar.passes.roll` writes at its loops' edges.

Under the interleaved 1F1B schedule stage `r` runs virtual stages `r, S + r, ...,
(v - 1) S + r`. A stack unrolled in Python keeps each layer's leaves on the devices of
the stage that runs it, so a group of `n = S v q` rows (`q` loop steps per virtual
stage) split over the stage axis holds, on stage `r`, its chunks' rows: the group is
stored in *chunk order*, row `p = r v q + c q + i` holding loop step `u = (c S + r) q +
i`. The loops read their per-step inputs in layer (step) order, so

* `chunk_rows(x)` is `x` (chunk order) in layer order, and
* `unchunk_rows(y)` is `y` (layer order) in chunk order.

Both are plain permutations of dim 0 (`jax.jit` runs them so). Their sharding rule is
the identity: the staged program of a pipeline (manual over the stage axis) reads each
stage's rows of a value in chunk order, so where a pipeline's loop reads `chunk_rows(x)`
it reads `x` itself, and where its per-step results are only read through
`unchunk_rows`, they leave as they are: no rows move between stages
(`autopar.passes.interleave.resident`). The lowering runs them as permutations
anywhere else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

CHUNK_OPS = ("chunk_rows", "unchunk_rows")


def _permute(x, stages: int, virtual: int, back: bool):
    q = x.shape[0] // (stages * virtual)
    first = (virtual, stages) if back else (stages, virtual)
    y = x.reshape(*first, q, *x.shape[1:])
    return jnp.swapaxes(y, 0, 1).reshape(x.shape)


def _primitive(name: str, back: bool) -> Primitive:
    p = Primitive(name)

    def impl(x, *, stages: int, virtual: int):
        return _permute(x, stages, virtual, back)

    p.def_impl(impl)
    p.def_abstract_eval(lambda x, **_: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
    return p


chunk_rows_p = _primitive("chunk_rows", back=False)
unchunk_rows_p = _primitive("unchunk_rows", back=True)


def chunk_rows(x, stages: int, virtual: int):
    """`x`, its rows in chunk order, in layer order (module doc)."""
    return chunk_rows_p.bind(x, stages=stages, virtual=virtual)


def unchunk_rows(y, stages: int, virtual: int):
    """`y`, its rows in layer order, in chunk order (module doc)."""
    return unchunk_rows_p.bind(y, stages=stages, virtual=virtual)


def chunk_position(u: int, stages: int, virtual: int, steps: int) -> int:
    """The row in chunk order of loop step `u` of `steps` (module doc)."""
    q = steps // (stages * virtual)
    w, i = divmod(u, q)
    c, r = divmod(w, stages)
    return r * virtual * q + c * q + i
