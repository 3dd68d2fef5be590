"""The interleaved schedule's layer order (`autopar.passes.pipeline.chunk_moves`), inside
the staged program (manual over the stage axis): a loop's per-layer rows moved from
layer order (stage `d` holding layers `d k .. d k + k - 1`, as the loop's inputs are
split) to chunk order (stage `r`'s chunk `c` is virtual stage `c S + r`), and its
per-layer outputs back, by collective-permutes of one chunk of rows each."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autopar.passes.interleave import chunk_moves


def to_chunks(x, axis: str, stages: int, virtual: int):
    """This stage's rows of `x` (dim 0, layer order) as its chunks' rows."""
    return _move(x, axis, stages, virtual, back=False)


def from_chunks(x, axis: str, stages: int, virtual: int):
    """`to_chunks` undone: this stage's chunks' rows back in layer order."""
    return _move(x, axis, stages, virtual, back=True)


def _move(x, axis: str, S: int, v: int, back: bool):
    if v == 1:
        return x
    blocks = jnp.split(x, v, axis=0)
    moves = chunk_moves(S, v)
    if back:
        moves = {(b, a): tuple((q, p) for p, q in pairs) for (a, b), pairs in moves.items()}
    me = jax.lax.axis_index(axis)
    out = []
    for slot in range(v):
        got = None
        # each stage receives its `slot` from exactly one of these permutes: the one
        # whose source slot `src[stage]` names
        src = [next(a for (a, b), ps in moves.items() if b == slot and any(q == r for _, q in ps))
               for r in range(S)]  # fmt: skip
        for (a, b), pairs in sorted(moves.items()):
            if b != slot:
                continue
            stays = all(p == q for p, q in pairs)  # each stage keeps its own block: no move
            y = blocks[a] if stays else jax.lax.ppermute(blocks[a], axis, list(pairs))
            got = y if got is None else jnp.where(jnp.asarray(src)[me] == a, y, got)
        out.append(got)
    return jnp.concatenate(out, axis=0)
