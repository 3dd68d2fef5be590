"""A stack's first layer that reads an argument of the step, padded to its
neighbour's ops so that it rolls with the others.

`jax.grad` computes no cotangent for an argument it does not differentiate, so when
a stack's first layer reads one directly (`for i in range(n): x = Dense(...)(x)` on
the batch, pre-norm blocks given `inputs_embeds`) that layer's backward block lacks
the ops that make its input gradient (`g @ W.T`, a residual's `add_any`, a norm's
backward), and its forward lacks the tangent ops of what it computes from that
argument alone (a norm's statistics, which JAX then evaluates outside the `jvp`). Its
ops differ from every other layer's, and a pass that needs the layers alike op for op
(`autopar.passes.roll`: one loop body for every stage) would leave it out.

`align` matches each of its blocks against the next layer's, op by op in that
layer's order (the same signature, reading the images of the same operands:
parameters by path, values made by ops matched before, the value entering the
block), and names each op it lacks as a `Pad`: a copy of the neighbour's op reading
the images of its operands. `padded` writes the pads into the graph. Their results
are read by nothing but other pads (the input gradient nobody asked for), so the
step computes the same numbers; in a rolled loop the first stage computes them in
step with the others, which run the same body anyway. docs/algorithms.md, "Layer
stacks in unrolled graphs".
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autopar.ir.graph import FORWARD, Graph, Node, check_graph

Operand = int | tuple[int, int]  # a value id, or (pad index, output index)


@dataclass(frozen=True)
class Pad:
    """An op the first layer's block lacks: a copy of node `like` (of the next layer's
    block) reading `inputs`, placed right after node `after` of the first layer's block
    (or before its first op, -1)."""

    like: int
    inputs: tuple[Operand, ...]
    after: int
    phase: int  # the first layer's forward block (0) or backward block (1)


def reads_argument(graph: Graph, params: Collection[int], block: Iterable[int]) -> bool:
    """Whether the ops `block` read an argument of the step other than `params`."""
    inputs = set(graph.inputs) - set(params)
    return any(x in inputs for i in block for x in graph.nodes[i].inputs)


def first_layer_pads(st: Any, k: int, ref: int, fblocks, bblocks) -> tuple[Pad, ...] | None:
    """The ops layer `k`'s forward and backward lack against layer `ref`'s, where `k`
    reads an argument of the step and its blocks are `ref`'s less those ops; then its
    blocks in `fblocks`/`bblocks` are set to all of its own. `st`: the analysis of
    `autopar.passes.stacks._Stack` (not imported: that module imports this one)."""
    g = st.g
    lead = _lead_in(st, fblocks[k])
    if not fblocks[k] or not reads_argument(g, st.param, fblocks[k] | lead):
        return None
    vm = st._value_map(ref, k, [])  # parameters by path
    # the ops before it on arguments alone: its own (a norm's statistics), or no layer's
    # (a frozen embedding below a LoRA stack, whose input gradient JAX does not compute)
    for fwd in (fblocks[k] | lead, fblocks[k]):
        pads: list[Pad] = []
        made: dict[int, tuple[int, int]] = {}  # a `ref` value a pad makes -> its operand
        if ok := align(g, fblocks[ref], fwd, vm, st.sig, 0, pads, made):
            break
    # backward, its tail was matched from its neighbour's, which has the ops it lacks:
    # what the labels give it and no block took is its own
    bwd = bblocks[k] | {i for i, b in st.bl.items() if b == k and i not in st.owner}
    if ok and bblocks[k]:
        ok = align(g, bblocks[ref], bwd, vm, st.sig, 1, pads, made)
    if not ok or not pads:
        return None
    fblocks[k], bblocks[k] = fwd, bwd if bblocks[k] else bblocks[k]
    return tuple(pads)


def _lead_in(st: Any, block: set[int]) -> set[int]:
    """The forward ops of no layer that compute from arguments of the step (not
    parameters) and constants alone for `block` only (what JAX evaluates without a
    tangent in a first layer whose input is not differentiated: a norm's statistics)."""
    g, made, ops = st.g, set(), []
    args = set(g.inputs) - set(st.param)
    for n in g.nodes:
        if n.id in block:
            break
        if (
            st.phase[n.id] == FORWARD
            and n.id not in st.owner
            and n.id not in st.lo
            and all(x in args or x in g.consts or x in made for x in n.inputs)
        ):
            made.update(n.outputs)
            ops.append(n.id)
    keep: set[int] = set()
    for i in reversed(ops):  # each read by the block, or by what it keeps, and the backward
        readers = {c for y in g.nodes[i].outputs for c in st.cons.get(y, ())}
        ours = readers & (block | keep)
        if ours and all(c in ours or st.phase[c] != FORWARD for c in readers):
            keep.add(i)
    return keep


def align(
    graph: Graph,
    ref: Sequence[int],
    short: Sequence[int],
    vm: dict[int, int],
    sig: Callable[[int], Any],
    phase: int,
    pads: list[Pad],
    padded: dict[int, tuple[int, int]],
) -> bool:
    """Whether block `short` is block `ref` (node ids) less some ops; those are added to
    `pads` as pads of block `phase` (0 forward, 1 backward). `vm` maps `ref`'s layer's
    values to `short`'s (parameters first) and `padded` the values earlier pads make
    to their operands; both grow with what the blocks' ops make and read from outside.

    Ops are matched in `ref`'s order by signature and dataflow (each reads the images of
    what its counterpart reads); ops on constants alone (a literal's broadcast) match
    through the op that reads them, as nothing else tells them apart."""
    nodes, consts = graph.nodes, graph.consts
    made = {y for i in ref for y in nodes[i].outputs}
    fixed = _on_constants(graph, ref) | _on_constants(graph, short)
    free = sorted(short)
    pair: dict[int, int] = {}  # ref op -> its `short` counterpart
    taken: set[int] = set()
    for r in sorted(ref):
        if r in fixed:
            continue
        op = nodes[r]
        t = next((t for t in free if t not in taken and sig(t) == sig(r)
                  and _reads_alike(graph, op, nodes[t], vm, made, fixed, sig)), None)  # fmt: skip
        if t is None:
            continue
        todo = list(zip(op.inputs, nodes[t].inputs))
        while todo:  # the constants' ops it reads (and theirs): matched by their reader
            x, y = todo.pop()
            vm.setdefault(x, y)
            c, d = graph.producer.get(x), graph.producer.get(y)
            if c in fixed and c not in pair:
                if d not in fixed or sig(d) != sig(c):
                    return False
                pair[c] = d
                taken.add(d)
                vm.update(zip(nodes[c].outputs, nodes[d].outputs))
                todo += zip(nodes[c].inputs, nodes[d].inputs)
        pair[r] = t
        taken.add(t)
        vm.update(zip(op.outputs, nodes[t].outputs))
    order = [pair[r] for r in sorted(ref) if r in pair]
    if len(order) != len(free) or order != sorted(order):  # all of `short`, in order
        return False
    after = -1
    for r in sorted(ref):
        if r in pair:
            after = pair[r]
            continue
        op, ins = nodes[r], []
        for x in op.inputs:
            if x in vm or x in padded:
                ins.append(vm[x] if x in vm else padded[x])
            elif x in consts:
                ins.append(x)
            else:  # read from outside, and no op of `short` reads its image
                return False
        padded.update((y, (len(pads), j)) for j, y in enumerate(op.outputs))
        pads.append(Pad(r, tuple(ins), after, phase))
    return True


def _on_constants(graph: Graph, ids: Sequence[int]) -> set[int]:
    """The ops of `ids` that read constants alone, or what such ops make."""
    out: set[int] = set()
    made: set[int] = set()
    for i in sorted(ids):
        n = graph.nodes[i]
        if all(x in graph.consts or x in made for x in n.inputs):
            out.add(i)
            made.update(n.outputs)
    return out


def _reads_alike(g: Graph, op: Node, t: Node, vm, made, fixed, sig) -> bool:
    """Whether `t` reads what `op` reads, by `vm` (a value from outside that `vm` does
    not map yet may be anything; a constant's op's result, the result of one alike; one
    a pad makes, nothing)."""
    if len(op.inputs) != len(t.inputs):
        return False
    for x, y in zip(op.inputs, t.inputs):
        if x in vm:
            if vm[x] != y:
                return False
        elif (c := g.producer.get(x)) in fixed:
            d = g.producer.get(y)
            if (
                d not in fixed
                or sig(d) != sig(c)
                or not all(
                    _same_literal(g.consts, a, b)
                    for a, b in zip(g.nodes[c].inputs, g.nodes[d].inputs)
                    if a in g.consts
                )
            ):
                return False
        elif x in made or x in g.consts and not _same_literal(g.consts, x, y):
            return False
    return True


def _same_literal(consts, x: int, y: int) -> bool:
    if y not in consts:
        return False
    a, b = np.asarray(consts[x]), np.asarray(consts[y])
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def trimmed(stack: Any) -> Any:
    """`stack` (a `LayerStack`) without a padded first layer, the layer named left out
    (None where there is none, or two layers would not remain)."""
    if not stack.pads or len(stack.forward) < 3:
        return None
    first = stack.forward[0].index
    bwd = tuple(b for b in stack.backward if b.index != first)
    return replace(stack, forward=stack.forward[1:], backward=bwd, pads=(), left_out=(first,))


def with_trims(stacks) -> list:
    """`stacks`, then each without a padded first layer (`trimmed`): what
    rolls where the whole stack does not split into the stages."""
    return [*stacks, *(t for s in stacks if (t := trimmed(s)) is not None)]


def split_stacks(stacks, S: int, auto: bool) -> list:
    """`stacks` (and their trims) whose depth `S` does not divide, each with its first
    layers outside so that the rest splits into `S` stages (`LayerStack.split_into`);
    under `pipeline_stages="auto"` only where no more than a stage's worth of layers
    would be left outside (96 layers on 64 stages would leave 32)."""
    out = []
    for s in with_trims(stacks):
        t = s.split_into(S)
        if t is not None and (not auto or len(t.forward) // S >= len(s.forward) - len(t.forward)):
            out.append(t)
    return out


def padded(stack: Any, graph: Graph) -> tuple[Graph, Any] | None:
    """`graph` with `stack.pads` written in (each right after its `after` op, once what
    it reads is made) and `stack` (an `autopar.passes.stacks.LayerStack`) in the new
    numbering, without pads, the first layer's blocks holding them; None where a pad
    would have to come after a later op of its block (it would not line up)."""
    pads = stack.pads
    first = (sorted(stack.forward[0].nodes), sorted(stack.backward[-1].nodes))
    values = list(graph.values)
    made_at = {v: n.id for n in graph.nodes for v in n.outputs}
    outs: list[tuple[int, ...]] = []
    placed: list[int] = []  # per pad: the node id it comes right after
    for p in pads:
        like, short = graph.nodes[p.like], first[p.phase]
        outs.append(tuple(range(len(values), len(values) + len(like.outputs))))
        values.extend(graph.values[v] for v in like.outputs)
        start = p.after if p.after >= 0 else short[0] - 1
        ready = [made_at.get(x, -1) if isinstance(x, int) else placed[x[0]] for x in p.inputs]
        placed.append(max([start, *ready]))
        if any(start < i <= placed[-1] for i in short):
            return None
    nodes: list[Node] = []
    renum: dict[int, int] = {}
    pad_ids: tuple[list[int], list[int]] = ([], [])  # per phase

    def emit(at: int) -> None:
        for k, p in enumerate(pads):
            if placed[k] == at:
                ins = tuple(x if isinstance(x, int) else outs[x[0]][x[1]] for x in p.inputs)
                pad_ids[p.phase].append(len(nodes))
                nodes.append(
                    replace(graph.nodes[p.like], id=len(nodes), inputs=ins, outputs=outs[k])
                )

    emit(-1)
    for n in graph.nodes:
        renum[n.id] = len(nodes)
        nodes.append(replace(n, id=len(nodes)))
        emit(n.id)
    out = replace(graph, values=tuple(values), nodes=tuple(nodes))
    check_graph(out)

    def moved(b, extra=()):
        return replace(b, nodes=tuple(sorted([*(renum[i] for i in b.nodes), *extra])))

    fwd = (moved(stack.forward[0], pad_ids[0]), *map(moved, stack.forward[1:]))
    back = (*map(moved, stack.backward[:-1]), moved(stack.backward[-1], pad_ids[1]))
    return out, replace(stack, forward=fwd, backward=back, pads=())
