"""Rematerialization of layers unrolled in Python: recompute a layer's residuals
just before its backward pass reads them.

A differentiated step whose layers are unrolled (a Python loop over blocks, as every
`transformers` Flax model and most linen and NNX code write them) computes all forward
layers, then all backward layers in reverse. Each backward layer reads its forward
layer's intermediates (*residuals*: activations, softmax weights, norm statistics),
which therefore live from the forward pass to the backward one and dominate the
step's activation memory. `remat_layers(graph, forward, backward, policy)` rewrites
the graph, layer by layer, so that each layer stores less and the rest is
recomputed, with copies of the forward layer's ops, right before the first backward
op of that layer that reads it:

- `"full"`: only what enters the layer from outside (the activation, masks, position
  ids, its weights) stays stored; every residual made inside the layer is recomputed.
- `"dots"`: contraction outputs stay stored as well (`jax.checkpoint_policies.
  dots_saveable`); the elementwise, softmax and norm intermediates are recomputed.
- `"selective"`: like `"dots"`, but the contractions with the fewest FLOPs per output
  byte (the attention scores) are recomputed too (Korthikanti et al.).

`layers` limits the rewrite to those layer indices (a per-layer choice: the search
keeps the activations of some layers and recomputes the others).

As `jax.checkpoint` does, the recomputation reads its inputs through
`optimization_barrier`s (one per input, so that each can be split its own way), so XLA
cannot merge the copies with the forward ops (common subexpression elimination would
undo the remat); the activation's barrier also takes one value the backward op
computes just before (its cotangent), so the copies that read it cannot run
before the backward pass reaches the layer where XLA schedules with the barriers in
place (XLA:GPU's pipeline, as read in its source, removes them after scheduling;
not measured here). XLA:CPU removes them before it schedules (right after CSE), so
there they stop CSE only and the order is its DFS scheduler's: with a trained parameter
below the stack (an embedding), whose gradient the cotangent chain alone feeds, it
runs that chain through every layer, copies included, before any layer's weight
gradients, which then hold every layer's recomputed residuals (`jax.checkpoint` per
layer does the same; a scanned stack does not). With `wait_for_gradients` (the
compiler drops the barriers: `autopar.meshes.drops_barriers`), layer i's recomputation
therefore also waits, by data, for layer i + 1's weight gradients: its activation
gets `0 * isfinite(sum of the max of each)` added (`_zero_after`: a max, as XLA
rewrites a sum of a contraction into a contraction of sums and would not wait for the
contraction itself; 0 also where a gradient is not finite, and `x * 0` on floats is
not folded), and so does every copied op that reads no activation, through its smallest
numeric operand (a dropout mask's key fold-in data, a weight before its cast: else
XLA:CPU draws every layer's mask at once), so at most one layer's recomputed residuals
live at once. On a mesh each
max is a scalar all-reduce over the axes its gradient is split on, and waits for the
gradient's own all-reduce, which is why it is not done where barriers order the
recomputation. The graph computes the same numbers; its
nodes are renumbered (new nodes are inserted), its inputs and outputs are unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from autopar.cost.model import node_flops
from autopar.ir.capture import append_traced
from autopar.ir.graph import Graph, Node, check_graph
from autopar.ir.ops import CONTRACTIONS

POLICIES = ("none", "dots", "selective", "full")  # from most to least memory


def cheapest_contractions(graph: Graph, nodes: Collection[int] | None = None) -> frozenset[int]:
    """The contraction outputs (of `nodes`, default all) with the fewest FLOPs per output
    byte (ties within 1%): what `"selective"` recomputes besides what `"dots"` does."""
    ops = graph.nodes if nodes is None else [graph.nodes[n] for n in nodes]
    ratios = {
        v: node_flops(n, graph) / max(graph.values[v].nbytes, 1)
        for n in ops
        if n.op in CONTRACTIONS
        for v in n.outputs
    }
    if len(set(ratios.values())) < 2:  # nothing cheaper than the rest: as "dots"
        return frozenset()
    low = min(ratios.values())
    return frozenset(v for v, r in ratios.items() if r <= 1.01 * low)


@dataclass(frozen=True)
class LayerRemat:
    """What the rewrite did to one layer."""

    index: int
    recomputed: int  # residuals the backward now recomputes
    stored: int  # residuals it still reads as stored, and what the recomputation reads
    recomputed_bytes: int  # net bytes no longer kept from the forward to the backward pass
    recompute_flops: float
    waits: bool = False  # for the weight gradients of the layer above (`wait_for_gradients`)


def _recompute_set(
    graph: Graph, nodes: frozenset[int], residuals: Sequence[int], policy: str
) -> tuple[list[int], list[int]]:
    """(the residuals to recompute, the layer's nodes that recompute them in program
    order), under `policy`."""
    saved: set[int] = set()
    if policy in ("dots", "selective"):
        dots = {
            v for n in nodes if graph.nodes[n].op in CONTRACTIONS for v in graph.nodes[n].outputs
        }
        saved = dots - cheapest_contractions(graph, nodes) if policy == "selective" else dots
    todo = [v for v in residuals if v not in saved]
    need: set[int] = set()
    stack = list(todo)
    producer = graph.producer
    while stack:
        v = stack.pop()
        n = producer.get(v)
        if n is None or n not in nodes or n in need:
            continue
        need.add(n)
        stack.extend(x for x in graph.nodes[n].inputs if x not in saved)
    return todo, sorted(need)


def remat_layers(
    graph: Graph,
    forward: Sequence[Collection[int]],
    backward: Sequence[Collection[int]],
    policy: str,
    layers: Collection[int] | None = None,
    wait_for_gradients: bool = False,
) -> tuple[Graph, tuple[LayerRemat, ...]]:
    """`graph` with the residuals of forward layer i (node ids `forward[i]`) that
    backward ops (`backward[i]` holds layer i's, any layer's count) read recomputed under
    `policy`, for each i in `layers` (default: all); and what changed per layer. With
    `wait_for_gradients`, each recomputation waits for the weight gradients of the layer
    whose backward runs before it (the module docstring says why)."""
    if policy not in POLICIES:
        raise ValueError(f"remat policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "none" or not forward or not backward:
        return graph, ()
    back = frozenset(n for b in backward for n in b)
    fwd_end = max(n for b in forward for n in b)
    outputs = set(graph.outputs)
    consumers = graph.consumers
    # per insertion point (a node id): [(layer, nodes to copy, values to recompute,
    # the cotangent the copies wait for, the previous backward layer's results they wait for)]
    inserts: dict[int, list[tuple[int, list[int], list[int], int | None, list[int]]]] = {}
    report: list[LayerRemat] = []
    for i, block in enumerate(forward):
        if layers is not None and i not in layers:
            continue
        nodes = frozenset(block)
        # read backward, and by nothing else outside the layer: what the layer passes on
        # to the next one is the next one's stored input, never recomputed
        residuals = [
            v
            for n in sorted(nodes)
            for v in graph.nodes[n].outputs
            if v not in outputs
            and any(c in back for c in consumers.get(v, ()))
            and all(c in back or c in nodes for c in consumers.get(v, ()))
        ]
        todo, copy = _recompute_set(graph, nodes, residuals, policy)
        if not todo:
            continue
        at = min(c for v in todo for c in consumers[v] if c in back)
        # the cotangent entering layer i's backward: the latest value it reads that the
        # backward pass made outside it, before `at`; the copies wait for it
        own = frozenset(backward[i])
        made_before = [
            (graph.producer[x], x)
            for n in own
            for x in graph.nodes[n].inputs
            if fwd_end < graph.producer.get(x, -1) < at and graph.producer[x] not in own
        ]
        trigger = max(made_before)[1] if made_before else None
        after = _weight_gradients(graph, backward, i, at) if wait_for_gradients else []
        inserts.setdefault(at, []).append((i, copy, todo, trigger, after))
        # what the copies read that the layer made (the dots "dots" saves): kept now
        made = {v for n in copy for v in graph.nodes[n].outputs}
        kept = {
            x
            for n in copy
            for x in graph.nodes[n].inputs
            if x not in made and graph.producer.get(x) in nodes and x not in residuals
        }
        report.append(
            LayerRemat(
                i,
                len(todo),
                len(residuals) - len(todo) + len(kept),
                sum(graph.values[v].nbytes for v in todo)
                - sum(graph.values[v].nbytes for v in kept),
                sum(node_flops(graph.nodes[n], graph) for n in copy),
                waits=bool(after and trigger is not None),
            )
        )
    if not inserts:
        return graph, tuple(report)
    out = _rebuild(graph, inserts, back)
    check_graph(out)
    return out, tuple(report)


def _weight_gradients(
    graph: Graph, backward: Sequence[Collection[int]], i: int, at: int
) -> list[int]:
    """The results of the backward layer run just before layer i's (layer i + 1's: its
    weight and bias gradients) that exist before node `at`, other than the cotangent it
    passes down: what layer i's recomputation waits for (`_zero_after`)."""
    if i + 1 >= len(backward) or not backward[i + 1]:
        return []
    block, own = frozenset(backward[i + 1]), frozenset(backward[i])
    consumers, outputs = graph.consumers, set(graph.outputs)
    return [
        v
        for n in sorted(block)
        if n < at
        for v in graph.nodes[n].outputs
        if jnp.issubdtype(graph.values[v].dtype, jnp.floating)
        and (v in outputs or any(c not in block for c in consumers.get(v, ())))
        and not any(c in own for c in consumers.get(v, ()))
    ]


def _zero_after(*grads):
    """0.0 made from `grads`: a value XLA must wait for them to make and cannot fold away
    (it folds `x * 0` only for integers); 0 also where one is not finite."""
    total = sum(jnp.max(g).astype(jnp.float32) for g in grads)
    return jnp.isfinite(total).astype(jnp.float32) * 0.0


def _plus(x, zero):
    return x + zero.astype(x.dtype)


def _smallest_numeric(graph: Graph, inputs: Sequence[int]) -> int | None:
    """The position of the smallest integer or floating operand in `inputs` (None if
    none: a key, a predicate)."""
    ok = [
        (graph.values[x].nbytes, j)
        for j, x in enumerate(inputs)
        if not graph.values[x].extended
        and (
            jnp.issubdtype(graph.values[x].dtype, jnp.floating)
            or jnp.issubdtype(graph.values[x].dtype, jnp.integer)
        )
    ]
    return min(ok)[1] if ok else None


def _barrier_groups(graph: Graph, ext: list[int], trigger: int | None) -> list[tuple[int, ...]]:
    """The barriers the copies read `ext` through: one per value, but the cotangent
    `trigger` shares one with the values of its shape (the activation entering the
    layer; the barrier splits those alike), or else with the largest value, so the
    copies that read them wait for the backward pass to reach the layer. One barrier
    over all would let a mesh axis shard only one of them
    (`strategies.elementwise.identity_tuple_rule`): every weight gathered but one."""
    if trigger is None:
        return [(x,) for x in ext]
    shape = graph.values[trigger].shape
    mates = [x for x in ext if graph.values[x].shape == shape and x != trigger]
    if not mates and ext:
        mates = [max(ext, key=lambda x: graph.values[x].nbytes)]
    head = tuple(dict.fromkeys([*mates, trigger]))
    return [head] + [(x,) for x in ext if x not in head]


def _rebuild(graph: Graph, inserts, back: frozenset[int]) -> Graph:
    values, consts = list(graph.values), dict(graph.consts)
    new_nodes: list[Node] = []
    # backward readers read the recomputed copy: value -> copy, from its insertion on
    swap: dict[int, int] = {}
    at_swap: dict[int, int] = {}

    def fresh(v: int) -> int:
        values.append(graph.values[v])
        return len(values) - 1

    def emit(node: Node, inputs, outputs) -> None:
        new_nodes.append(replace(node, id=len(new_nodes), inputs=tuple(inputs), outputs=outputs))

    for node in graph.nodes:
        for _, copy, todo, trigger, after in inserts.get(node.id, ()):
            made = {v for n in copy for v in graph.nodes[n].outputs}
            ext = list(
                dict.fromkeys(
                    x
                    for n in copy
                    for x in graph.nodes[n].inputs
                    if x not in made and x not in graph.consts
                )
            )
            local: dict[int, int] = {}
            where = (node.name_stack, node.source)
            zero = None
            if trigger is not None and after:  # the copies wait for the layer above
                (zero,) = append_traced(values, new_nodes, consts, _zero_after, after, *where)

            def waiting(x: int, zero=zero, where=where) -> int:  # x, made to wait for `zero`
                return append_traced(values, new_nodes, consts, _plus, [x, zero], *where)[0]

            waits: set[int] = set()  # values of the layer that wait for `zero`
            for k, group in enumerate(_barrier_groups(graph, ext, trigger)):
                outs = tuple(fresh(x) for x in group)
                ins = group
                if k == 0 and zero is not None:  # the activation
                    ins = tuple(x if x == trigger else waiting(x) for x in group)
                    waits.update(x for x in group if x != trigger)
                new_nodes.append(
                    Node(
                        len(new_nodes),
                        "optimization_barrier",
                        ins,
                        outs,
                        jax.lax.optimization_barrier_p,  # as capture's
                        {},
                        node.name_stack,
                        node.source,
                        library_source=node.library_source,
                    )
                )
                local.update(zip(group, outs))
            for n in copy:
                orig = graph.nodes[n]
                ins = [local.get(x, x) for x in orig.inputs]
                # a copy that reads no activation (a dropout mask's key, a weight's cast)
                # waits through its smallest numeric operand, where it has one
                root = zero is not None and not waits.intersection(orig.inputs)
                j = _smallest_numeric(graph, orig.inputs) if root else None
                if j is not None:
                    ins[j] = waiting(ins[j])
                if not root or j is not None:
                    waits.update(orig.outputs)
                outs = tuple(fresh(v) for v in orig.outputs)
                emit(orig, ins, outs)
                local.update(zip(orig.outputs, outs))
            for v in todo:
                swap[v] = local[v]
            if trigger is not None and trigger in node.inputs:  # read through the barrier
                at_swap[trigger] = local[trigger]
        ins = (at_swap.get(x, swap.get(x, x)) if node.id in back else x for x in node.inputs)
        emit(node, ins, node.outputs)
        at_swap.clear()
    return replace(graph, values=tuple(values), nodes=tuple(new_nodes), consts=consts)
