"""A backward loop body cut in two for the zero-bubble schedule (ZB-H1): the ops the
input gradient needs (`B`: the carry's cotangent, which the previous stage waits for)
and the rest (`W`: the weight gradients, which nothing in the pipeline waits for).

    body(consts, carry, xs) -> (carry', ys)
    B(consts, carry, xs)    -> (carry', boundary)      on the critical path
    W(consts, xs, boundary) -> ys                       any time later

`B` holds every op the carry's outputs depend on; `W` the ops only the per-layer
outputs (`ys`: weight gradients) need. `boundary` are the values `W` reads that `B`
makes or that enter as the carry (the cotangents at each weight-gradient product): a
stage keeps them from a micro-batch's `B` to its `W`, so they cost memory for every
micro-batch in between. A value `B` makes from the loop's inputs (consts, xs) by cheap
ops alone (`RECOMPUTED`: elementwise, shape ops, row reductions; a layer norm's
output recomputed from a saved activation under remat) is made again in `W` instead
(`WeightSplit.recomputed`): memory-bound work on a pass off the critical path, for
one fewer activation-sized value kept per micro-batch. Every other op runs once, in
one part, under the body's own plan. A `ys` output that `B` makes (or that is an
input) passes through the boundary. docs/algorithms.md, "Zero-bubble pipeline
(ZB-H1)", has the schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from autopar.cost.model import FUSED_OPS
from autopar.ir.graph import Graph, upstream

# What `W` makes again rather than keep: ops XLA fuses (elementwise, shape ops) and the
# row reductions of a norm, all memory-bound
RECOMPUTED = FUSED_OPS | {"reduce_sum", "reduce_max", "reduce_min"}


@dataclass(frozen=True)
class WeightSplit:
    """A backward body's `B` and `W` graphs (`split_weight_grads`). Node ids are each
    graph's own positions; `b_nodes`/`w_nodes` are their ids in the body, in order.
    `w_inputs` are the body's input positions `W` takes (consts and xs) before the
    boundary values."""

    b: Graph
    w: Graph
    b_nodes: tuple[int, ...]
    w_nodes: tuple[int, ...]
    boundary: tuple[int, ...]  # value ids
    w_inputs: tuple[int, ...]
    recomputed: tuple[int, ...] = ()  # `B` nodes `W` runs again (in `w_nodes` too)


def _subgraph(body: Graph, nodes, inputs, outputs, name: str) -> Graph:
    """`body`'s `nodes` (ids, in order) as a graph of their own, renumbered."""
    kept = [replace(body.nodes[n], id=i) for i, n in enumerate(nodes)]
    paths = dict(zip(body.inputs, body.input_paths))
    return Graph(
        values=body.values,
        nodes=tuple(kept),
        inputs=tuple(inputs),
        input_paths=tuple(paths.get(v, f"boundary/{v}") for v in inputs),
        outputs=tuple(outputs),
        output_paths=tuple(f"out/{i}" for i in range(len(outputs))),
        consts=body.consts,
        name=name,
    )


@functools.lru_cache(maxsize=64)  # pricing, buffers, floor and lowering ask per body
def split_weight_grads(body: Graph, num_consts: int, num_carry: int) -> WeightSplit | None:
    """`body` (a backward loop's: inputs consts, carry, xs; outputs carry, ys) cut into
    `B` and `W`; None when `W` would hold no op (nothing to defer). A graph is
    immutable and hashed by identity, so the split is made once per body."""
    carry_out = body.outputs[:num_carry]
    ys = body.outputs[num_carry:]
    b_set = upstream(body, carry_out)
    w_set = upstream(body, ys) - b_set
    if not w_set:
        return None
    b_nodes = tuple(sorted(b_set))
    carry_in = set(body.inputs[num_consts : num_consts + num_carry])
    producer = body.producer
    # `B` nodes made from the loop's inputs by cheap ops alone, which `W` can redo
    free = (set(body.inputs) - carry_in) | set(body.consts)
    cheap: set[int] = set()
    for n in b_nodes:
        node = body.nodes[n]
        if node.op in RECOMPUTED and all(
            v in free or producer.get(v) in cheap for v in node.inputs
        ):
            cheap.add(n)
    redo: set[int] = set()
    todo = [producer.get(v) for n in w_set for v in body.nodes[n].inputs]
    while todo:
        n = todo.pop()
        if n in cheap and n not in redo:
            redo.add(n)
            todo += [producer.get(v) for v in body.nodes[n].inputs]
    w_nodes = tuple(sorted(w_set | redo))
    made_by_b = {v for n in b_nodes if n not in redo for v in body.nodes[n].outputs}
    reads = [v for n in w_nodes for v in body.nodes[n].inputs] + [
        v for v in ys if v not in {o for n in w_nodes for o in body.nodes[n].outputs}
    ]
    boundary = tuple(
        dict.fromkeys(
            v for v in reads if (v in made_by_b or v in carry_in) and v not in body.consts
        )
    )
    w_inputs = tuple(
        i for i in range(len(body.inputs)) if not num_consts <= i < num_consts + num_carry
    )
    b = _subgraph(body, b_nodes, body.inputs, (*carry_out, *boundary), f"{body.name}/B")
    w = _subgraph(
        body,
        w_nodes,
        (*(body.inputs[i] for i in w_inputs), *boundary),
        ys,
        f"{body.name}/W",
    )
    return WeightSplit(b, w, b_nodes, w_nodes, boundary, w_inputs, tuple(sorted(redo)))
