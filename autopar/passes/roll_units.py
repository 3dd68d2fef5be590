"""The ops outside a rolled stack that every layer repeats on its own values (the
optimizer's update of its leaves), matched across the stages so that each runs once
for all of them, `jax.vmap`ped over the groups' rows (`autopar.passes.roll`, which
calls `per_layer_ops` on its analysis; docs/algorithms.md, "Pipelining layers unrolled
in Python")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from autopar.ir.graph import signature

# `r` below is `autopar.passes.roll`'s analysis of one stack (`_Rolling`: the graph `g`,
# stages `S`, slots `k`, `leaf`, `rows`, `loops`, `stack`); not imported, as roll
# imports this module
_Rolling = Any


def per_layer_ops(r: _Rolling) -> dict[tuple[int, int], list[int]]:
    """The ops outside the stack that each layer repeats on its own values (the
    optimizer's update of its leaves): per (slot j, position q), the op of every
    stage's layer `s k + j`, run as one op over the stages (`jax.vmap`). An op is
    layer `l`'s when every per-layer value it reads is `l`'s (its leaves, what its
    ops hand out, what its per-layer ops make), and it runs as one op over the
    stages where every stage's layer has it at the same place (`_placed`). An op of
    one layer without a counterpart makes values of no layer: the ops are sorted
    again until the ops without one stay the same (a global norm's chain through
    the layers, left to its layers, made its sum the last layer's, and every
    gradient it scales two layers')."""
    g, k, S = r.g, r.k, r.S
    owned = {v: r.leaf[v][0] for v in r.leaf}
    block_layer = {i: n for n, b in enumerate(r.stack.forward) for i in b.nodes}
    by_index = {b.index: n for n, b in enumerate(r.stack.forward)}
    for b in r.stack.backward:
        block_layer.update((i, by_index[b.index]) for i in b.nodes)
    for v, (key, _) in r.rows.items():
        if key[0] == "ys" and key[2][0] != "in":
            owned[v] = block_layer[g.producer[v]]
    inside = {i for lp in r.loops for ch in lp.chunks for i in ch}
    ids: dict[tuple, int] = {}  # `_placed`'s numbering of places
    alone: set[int] = set()  # ops without a counterpart: what they make is no layer's
    for _ in range(8):  # a few rounds; any round's units run right (`roll._Rolling._run_op`)
        layer_of, per, quiet = dict(owned), {}, alone
        for n in g.nodes:
            if n.id in inside:
                continue
            layers = {layer_of[x] for x in n.inputs if x in layer_of}
            if len(layers) == 1:
                lay = layers.pop()
                per.setdefault(lay, []).append(n.id)
                if n.id not in quiet:
                    layer_of.update((y, lay) for y in n.outputs)
        units: dict[tuple[int, int], list[int]] = {}
        for j in range(k):
            placed = [_placed(r, per.get(s * k + j, []), layer_of, ids) for s in range(S)]
            common = [p for p in placed[0] if all(p in other for other in placed[1:])]
            for q, p in enumerate(common):
                units[(j, q)] = [other[p] for other in placed]
        matched = {i for nodes in units.values() for i in nodes}
        alone = {i for ops in per.values() for i in ops} - matched
        if alone == quiet:
            break
    for (j, q), nodes in units.items():
        for s, i in enumerate(nodes):
            for out, y in enumerate(g.nodes[i].outputs):
                r.rows[y] = (("op", j, q, out), s)
    return units


def _placed(
    r: _Rolling, ops: Sequence[int], layer_of: dict[int, int], ids: dict[tuple, int]
) -> dict[tuple, int]:
    """One layer's per-layer ops (program order) by their place in the layer, which
    is the same in every layer that runs the op: its signature and, per operand, the
    leaf (by position) or loop output (by place in the chunk) it reads, the place of
    the layer's op that made it, or a value of no layer, as computed (`_computed`:
    every layer reads the same learning rate, or a bias correction optax computes
    once per leaf). An op of one layer but not another has no counterpart and stays
    outside the per-layer ops; the others still run as one op over the stages.
    optax's `clip_by_global_norm` makes such ops: its norm sums the layers' squares
    in a chain through all layers, whose links read a value of no layer made from
    the layers before (a different one in each layer). Matching whole sequences
    instead left every slot of such a step unrolled, and every update reading its
    rows of the stage-split gradients and parameters: a gather of all of them
    across the stages."""
    g, out = r.g, {}
    made: dict[int, tuple] = {}
    seen: Counter = Counter()
    for i in ops:
        node = g.nodes[i]
        reads = []
        for x in node.inputs:
            if x in made:
                reads.append(made[x])
            elif x in r.leaf:
                reads.append(("leaf", r.leaf[x][1]))
            elif x in r.rows and r.rows[x][0][0] == "ys":
                reads.append(r.rows[x][0])
            else:
                reads.append(_computed(r, x, layer_of))
        place = (signature(g, node), tuple(reads))
        seen[place] += 1
        place = (*place, seen[place])  # the n-th op of the same place
        out[place] = i
        at = ids.setdefault(place, len(ids))  # the same place, the same number
        made.update((y, ("op", at, k)) for k, y in enumerate(node.outputs))
    return out


def _computed(r: _Rolling, x: int, layer_of: dict[int, int], depth: int = 4) -> tuple:
    """Value `x` as the computation that makes it (`roll._Rolling._equal`'s: equal literals, ops of
    one signature on equal operands, `depth` deep), or as itself where it is a
    layer's value or made deeper."""
    g = r.g
    if x in g.consts:
        c = np.asarray(g.consts[x])
        return ("literal", c.shape, str(c.dtype), c.tobytes()) if c.size <= 64 else ("value", x)
    if depth == 0 or x not in g.producer or x in layer_of or x in r.rows:
        return ("value", x)
    n = g.nodes[g.producer[x]]
    operands = tuple(_computed(r, y, layer_of, depth - 1) for y in n.inputs)
    return ("made", n.outputs.index(x), signature(g, n), operands)
