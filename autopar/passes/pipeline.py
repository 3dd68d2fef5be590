"""Pipeline parallelism over a `scan` of layers: configuration and micro-batch analysis.

A pipelined scan runs its `length` steps (layers) in `stages` groups, one per index of
the mesh's stage axis, each group on its own sub-mesh of the other axes; the batch is
cut into `microbatches` that flow through the stages. The activations the forward
loop saves stay on the stage that made them (they are `ys` sliced per layer, split
over the stage axis like the weights). Under GPipe each scan is pipelined on its own
(every micro-batch's forward pass, then every backward one); under 1F1B a train
step's forward loop, the ops between it and the backward loop that reads its saved
activations (the head, `fuse`) and that backward loop run as one pipeline
(`autopar.lower.pipeline`).

To run one micro-batch, the loop body must be the same computation at the smaller
batch. Shapes are baked into a jaxpr, so autopar captures the function a second time
at the micro-batch size (`micro_capture`) and pairs each pipelined scan with its
counterpart there. Comparing the two bodies' value shapes labels every loop input and
output (`ScanLabels`):

* ``int d``  the value carries the batch on dim ``d`` (the micro value is ``1/M`` of
  it there): micro-batch ``m`` is the strided slice ``m::M`` of that dim;
* ``SUM``    an output without the batch dim that depends on batched inputs: a sum
  over the batch (a weight gradient), accumulated over micro-batches;
* ``SAME``   a value the batch does not touch (weights, their per-layer slices).

The labels are checked against the body (`_check_separable`, `autopar.passes.microbatch`):
every op must run per micro-batch without communication, a batch-free output may only
come from a *sum* over the batch, and a body with batch statistics inside is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from autopar.errors import MicrobatchError, PipelineError
from autopar.ir.graph import Graph, Node, TensorType
from autopar.passes.microbatch import (
    batch_operands,
    fits,
    mixing,
    separate,
    split_spec,
    sum_spec,
)
from autopar.sharding import MeshInfo, Spec

SUM = "sum"
SAME = "same"
Label = int | str
SCHEDULES = ("gpipe", "1f1b", "1f1b-async", "zb-h1", "interleaved")
# the schedules that run a forward loop, the head and the backward loop as one pipeline
# (`Fused`): lock-step 1F1B, 1F1B with stages alternating forward and backward
# half-slots, lock-step 1F1B with the weight gradients deferred (zero-bubble ZB-H1,
# `autopar.passes.zero_bubble`) and lock-step 1F1B over `virtual` chunks of layers per
# stage (interleaved 1F1B; `autopar.lower.pipeline`)
FUSED_SCHEDULES = ("1f1b", "1f1b-async", "zb-h1", "interleaved")


@dataclass(frozen=True)
class Pipeline:
    """How pipelined scans run: `stages` along mesh axis `axis`, `microbatches` per step;
    under the interleaved schedule each stage runs `virtual` chunks of its layers (stage
    `s` holds virtual stages `s, S + s, ..., (virtual - 1) S + s`)."""

    stages: int
    microbatches: int
    schedule: str = "gpipe"
    axis: str = "stage"
    virtual: int = 1

    def to_json(self) -> dict:
        out = {
            "stages": self.stages,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "axis": self.axis,
        }
        if self.virtual > 1:
            out["virtual_stages"] = self.virtual
        return out

    @staticmethod
    def from_json(d: dict) -> Pipeline:
        return Pipeline(
            int(d["stages"]),
            int(d["microbatches"]),
            d["schedule"],
            d["axis"],
            int(d.get("virtual_stages", 1)),
        )

    def ticks(self) -> int:
        """Slots of one pipelined loop: `M + S - 1`, or `M v + S - 1` chunk slots."""
        return self.microbatches * self.virtual + self.stages - 1


@dataclass(frozen=True)
class ScanLabels:
    """Per input and output of a scan node: a batch dim (of the body's value), SUM or SAME."""

    ins: tuple[Label, ...]
    outs: tuple[Label, ...]


@dataclass(frozen=True)
class Fused:
    """A forward layer loop and the backward loop that consumes its saved activations,
    run as one 1F1B pipeline together with the `head`: the ops between them that run
    per micro-batch (final norm, loss, its gradient, the output layer's weight
    gradient), on the last stage, as each micro-batch's forward pass leaves it.

    `head_ins`: the values the head reads from outside the region, each with its batch
    dim, or SAME (the forward loop's final carry is among them); `head_outs`: the head
    values the rest of the step reads, with their batch dim or SUM (a sum over the
    batch, accumulated over micro-batches). `micro_nodes` are the head's nodes traced at
    the micro-batch size, `micro_consts` the constants they read."""

    forward: int
    backward: int
    head: tuple[int, ...]
    head_ins: tuple[tuple[int, Label], ...]
    head_outs: tuple[tuple[int, Label], ...]
    micro_nodes: tuple[Node, ...]
    micro_consts: Mapping[int, Any]
    micro_types: Mapping[int, TensorType]  # of the head_outs, per micro-batch

    def members(self) -> frozenset[int]:
        return frozenset((self.forward, self.backward, *self.head))


@dataclass(frozen=True)
class PipelinedScans:
    """What the lowering needs: the pipeline, and per pipelined scan node id its body at
    the micro-batch size with its labels; with the 1F1B schedule, the fused loop pairs;
    for a stack unrolled in Python, the rolled graph and its `Roll`."""

    pipe: Pipeline
    scans: Mapping[int, tuple[Graph, ScanLabels]]
    fused: tuple[Fused, ...] = ()
    # a layer stack unrolled in Python, rolled into loops (`autopar.passes.roll`): the
    # rolled graph the pipeline applies to, and how its leaves stand for the user's
    graph: Graph | None = None
    roll: Any = None
    # why the schedule asked for by default (1F1B) gave way to GPipe, if it did
    fallback: str = ""

    def head_nodes(self) -> frozenset[int]:
        return frozenset(n for f in self.fused for n in f.head)


def sunk_fills(graph: Graph, pipelined: PipelinedScans) -> dict[int, dict[int, Node]]:
    """Per pipelined scan, the batched loop-invariant inputs that a `broadcast_in_dim`
    makes from a batch-free operand (a causal mask, the -inf of `jnp.where`, that JAX's
    partial evaluation hoisted out of the loop at the full batch): input index -> that
    broadcast. A stage rebuilds each, one micro-batch's worth, from the operand
    (`autopar.lower.pipeline`), so the lowered program never makes the whole value nor
    cuts it into micro-batches."""
    out: dict[int, dict[int, Node]] = {}
    for i, (_, labels) in pipelined.scans.items():
        node = graph.nodes[i]
        for k, (v, lab) in enumerate(zip(node.inputs, labels.ins)):
            p = graph.producer.get(v)
            made = graph.nodes[p] if p is not None else None
            if (
                k < node.params["num_consts"]
                and isinstance(lab, int)
                and made is not None
                and made.op == "broadcast_in_dim"
                and lab not in made.params["broadcast_dimensions"]
            ):
                out.setdefault(i, {})[k] = made
    return out


def check_stage_axis(pipe: Pipeline, mesh: MeshInfo) -> None:
    """That `mesh` has `pipe`'s stage axis, of its stage count (`parallelize` asks it of
    a mesh given with its axes before any trace)."""
    if pipe.axis not in mesh.axis_names:
        raise PipelineError(
            f"pipeline_stages={pipe.stages} needs a mesh axis {pipe.axis!r} of size {pipe.stages}; "
            f"the mesh is {mesh.shape}. Add it, e.g. mesh={{'{pipe.axis}': {pipe.stages}, "
            f"'data': ..., 'model': ...}}"
        )
    if mesh.size(pipe.axis) != pipe.stages:
        raise PipelineError(
            f"pipeline_stages={pipe.stages}, but the mesh's {pipe.axis!r} axis has "
            f"{mesh.size(pipe.axis)} devices (the mesh is {mesh.shape}): one stage per "
            f"device of that axis, so give pipeline_stages={mesh.size(pipe.axis)}, or a "
            f"{pipe.axis!r} axis of {pipe.stages}"
        )


def check_pipeline(pipe: Pipeline, mesh: MeshInfo) -> None:
    if pipe.schedule not in SCHEDULES:
        raise PipelineError(
            f"pipeline schedule {pipe.schedule!r} is not implemented; choose one of {SCHEDULES}"
        )
    check_stage_axis(pipe, mesh)
    if pipe.microbatches < 1:
        raise MicrobatchError(f"microbatches must be >= 1, got {pipe.microbatches}")
    if (pipe.virtual > 1) != (pipe.schedule == "interleaved"):
        raise PipelineError(
            f"virtual_stages={pipe.virtual} goes with pipeline_schedule='interleaved' only "
            f"(the schedule is {pipe.schedule!r})"
        )
    if pipe.virtual > 1 and pipe.microbatches % pipe.stages:
        raise MicrobatchError(
            f"the interleaved schedule runs micro-batches in groups of the {pipe.stages} "
            f"stages; {pipe.microbatches} micro-batches do not make whole groups. Pick "
            f"microbatches= a multiple of {pipe.stages}"
        )


def pipelined_scans(graph: Graph, pipe: Pipeline) -> tuple[int, ...]:
    """Ids of the scan nodes that are pipelined: loops whose length the stage count
    divides and that carry a batched value."""
    return tuple(
        n.id
        for n in graph.nodes
        if n.body is not None
        and n.params["length"] % (pipe.stages * pipe.virtual) == 0
        and n.params["num_carry"] >= 1
        and graph.values[n.inputs[n.params["num_consts"]]].rank >= 1
    )


def sub_mesh(mesh: MeshInfo, axis: str) -> MeshInfo:
    """The mesh one stage runs on: every axis but `axis`, devices of stage 0."""
    import numpy as np

    k = mesh.axis_names.index(axis)
    ids = np.take(np.array(mesh.device_ids).reshape(mesh.axis_sizes), 0, axis=k)
    names = tuple(a for a in mesh.axis_names if a != axis)
    sizes = tuple(s for a, s in zip(mesh.axis_names, mesh.axis_sizes) if a != axis)
    return MeshInfo.build(names, sizes, ids.reshape(-1).tolist(), mesh.devices_per_node)


def batch_size(graph: Graph, scans: Sequence[int]) -> int:
    """The batch: the leading dim of the first pipelined scan's carry."""
    n = graph.nodes[scans[0]]
    return graph.values[n.inputs[n.params["num_consts"]]].shape[0]


def feeding_carry(graph: Graph, scans: Sequence[int], batch: int) -> set[int]:
    """Positions of the step's inputs that the carry of the forward loops among `scans`
    is computed from, through values that lead with the batch (the activations, not the
    weights that make them, even where a weight's contracted dim is as long as the batch:
    `microbatch.batch_operands`; the backward loops' carry comes from everything)."""
    want = [
        v
        for i in scans
        for n in [graph.nodes[i]]
        if not n.params["reverse"]
        for v in n.inputs[n.params["num_consts"] : n.params["num_consts"] + n.params["num_carry"]]
    ]
    seen: set[int] = set()
    while want:
        v = want.pop()
        if v in seen or graph.values[v].shape[:1] != (batch,):
            continue
        seen.add(v)
        if v in graph.producer:
            node = graph.nodes[graph.producer[v]]
            ks = batch_operands(graph, node, node.outputs.index(v))
            want.extend(node.inputs[k] for k in ks)
    return {k for k, v in enumerate(graph.inputs) if v in seen}


def micro_args(
    flat_args: Sequence, batch: int, microbatches: int, fn_name: str, keep: Collection[int] = ()
) -> list:
    """Abstract args at the micro-batch size: every leaf whose leading dim is the batch,
    except the leaves at positions `keep` (state the function returns updated: a stack
    of 8 layers' weights is not a batch of 8)."""
    if batch % microbatches:
        raise MicrobatchError(
            f"{fn_name}: the batch of {batch} does not split into {microbatches} micro-batches; "
            "pick a micro-batch count that divides it"
        )
    out = []
    for i, x in enumerate(flat_args):
        shape = getattr(x, "shape", None)
        weak = bool(getattr(x, "weak_type", False))  # traced as the whole batch was
        if shape and shape[0] == batch and i not in keep:
            x = jax.ShapeDtypeStruct((batch // microbatches, *shape[1:]), x.dtype, weak_type=weak)
        elif shape is not None:
            x = jax.ShapeDtypeStruct(shape, x.dtype, weak_type=weak)
        out.append(x)
    return out


def scan_labels(full: Node, micro: Node, microbatches: int, loop: str) -> ScanLabels:
    """Label the loop's inputs and outputs by comparing the two captures' bodies; `loop`
    names the loop in errors (`the scan at model.py:12`, or the user's unrolled layers)."""
    fb, mb = full.body, micro.body
    if [n.op for n in fb.nodes] != [n.op for n in mb.nodes] or len(fb.values) != len(mb.values):
        # a micro-batch of one example: JAX drops size-1 dims (squeezes, reductions)
        ones = any(
            fb.values[x].shape[:1] != (1,) and mb.values[y].shape[:1] == (1,)
            for x, y in zip(fb.inputs, mb.inputs)
        )
        raise PipelineError(
            f"{loop}: a different computation at the micro-batch size "
            f"({len(fb.nodes)} vs {len(mb.nodes)} ops); pipelining needs a loop body whose "
            "ops do not depend on the batch size"
            + (
                f"; with {microbatches} micro-batches each has one example, which JAX "
                "traces with fewer ops (size-1 dims squeezed): use fewer micro-batches"
                if ones
                else ""
            )
        )

    def label(v_full: int, v_micro: int, what: str) -> Label:
        a, b = fb.values[v_full].shape, mb.values[v_micro].shape
        diff = [d for d, (x, y) in enumerate(zip(a, b)) if x != y]
        if not diff:
            return SAME
        if len(a) == len(b) and len(diff) == 1 and a[diff[0]] == b[diff[0]] * microbatches:
            return diff[0]
        raise PipelineError(
            f"{loop}: {what} is {list(a)} at the full batch but {list(b)} per "
            f"micro-batch; autopar can only cut the batch along one dim"
        )

    ins = tuple(
        label(a, b, f"loop input {i}") for i, (a, b) in enumerate(zip(fb.inputs, mb.inputs))
    )
    batched = {v for v, lab in zip(fb.inputs, ins) if lab != SAME}
    for n in fb.nodes:
        if any(v in batched for v in n.inputs):
            batched.update(n.outputs)
    outs = tuple(
        (SUM if a in batched else SAME) if (lab := label(a, b, f"loop output {i}")) == SAME else lab
        for i, (a, b) in enumerate(zip(fb.outputs, mb.outputs))
    )
    n_c, n_k = full.params["num_consts"], full.params["num_carry"]
    carry_in, carry_out = ins[n_c : n_c + n_k], outs[:n_k]
    if carry_in != carry_out or any(not isinstance(lab, int) for lab in carry_in):
        raise PipelineError(
            f"{loop} carries values that are not cut along the batch "
            f"(labels in {carry_in}, out {carry_out}); only a loop whose carry is the batched "
            "activation can be pipelined"
        )
    _check_separable(fb, mb, ins, outs, microbatches, loop)
    return ScanLabels(ins, outs)


def _check_separable(
    body: Graph, micro_body: Graph, ins, outs, microbatches: int, loop: str
) -> None:
    """Refuse a body that mixes micro-batches (e.g. a batch mean fed back into the
    activations), which would silently compute something else per micro-batch: every
    op must run per micro-batch (`autopar.passes.microbatch.separate`), and the outputs must
    come out as labelled: batched ones split the same way, sums as Partial sums,
    batch-free ones whole."""

    def spec(v: int, lab: Label) -> Spec:
        rank = body.values[v].rank
        if lab == SUM:
            return sum_spec(rank)
        return Spec.replicated(rank) if lab == SAME else split_spec(rank, lab)

    have, bad = separate(
        body, [spec(v, lab) for v, lab in zip(body.inputs, ins)], microbatches, micro_body
    )
    if bad is not None:
        raise PipelineError(
            f"{loop} cannot run micro-batch by micro-batch: its body's "
            f"{bad.op} at {bad.key} mixes the batch's examples ({mixing(body, have, bad)}); "
            "pipelining needs a loop whose steps treat every example separately (no batch "
            "statistics inside, such as a load-balancing loss over the tokens)"
        )
    for v, lab in zip(body.outputs, outs):
        want = spec(v, lab)
        got = have.get(v, Spec.replicated(body.values[v].rank))
        if got != want and not (lab != SUM and fits(want, got)):
            raise PipelineError(
                f"{loop}: a loop output {body.values[v]} comes out {got} per "
                f"micro-batch where {want} was expected; this loop cannot be pipelined"
            )


def with_full_consts(micro_body: Graph, full_body: Graph) -> Graph:
    """The micro-batch body with the full body's constants wherever their shapes agree.
    A sharded program keeps the global program's constants on every shard; so must a
    micro-batch (a batch mean's `1/B` inside the loop must not become `M/B`)."""
    consts = {
        v: full_body.consts[v]
        if v in full_body.consts and full_body.values[v] == micro_body.values[v]
        else c
        for v, c in micro_body.consts.items()
    }
    return replace(micro_body, consts=consts)


def stage_layers(node: Node, pipe: Pipeline) -> int:
    return node.params["length"] // pipe.stages


def chunk_layers(node: Node, pipe: Pipeline) -> int:
    """The layers a stage runs per slot: all of its own, or one of its `virtual` chunks."""
    return node.params["length"] // (pipe.stages * pipe.virtual)


def layer_ranges(node: Node, pipe: Pipeline) -> list[tuple[int, int]]:
    k = stage_layers(node, pipe)
    return [(s * k, (s + 1) * k) for s in range(pipe.stages)]


def ancestors(graph: Graph, start: int) -> set[int]:
    """Ids of the nodes node `start` depends on (itself included)."""
    producer = graph.producer
    out, todo = {start}, [start]
    while todo:
        for v in graph.nodes[todo.pop()].inputs:
            p = producer.get(v)
            if p is not None and p not in out:
                out.add(p)
                todo.append(p)
    return out


def descendants(graph: Graph, start: int) -> set[int]:
    """Ids of the nodes that depend on node `start`'s outputs (itself included)."""
    consumers = graph.consumers
    out, todo = {start}, [start]
    while todo:
        for v in graph.nodes[todo.pop()].outputs:
            for c in consumers.get(v, ()):
                if c not in out:
                    out.add(c)
                    todo.append(c)
    return out


def fuse(graph: Graph, micro: Graph, scans: Mapping[int, tuple[Graph, ScanLabels]], M: int):
    """The 1F1B regions of `graph`: each forward pipelined loop with the reversed one
    that reads its `ys` (saved activations), and the per-micro-batch ops between them.
    Raises PipelineError, naming the op, where the step does not split that way."""
    out = []
    for f in sorted(scans):
        F = graph.nodes[f]
        if F.params["reverse"]:
            continue
        ys = set(F.outputs[F.params["num_carry"] :])
        backs = [
            b
            for b in scans
            if graph.nodes[b].params["reverse"] and any(v in ys for v in graph.nodes[b].inputs)
        ]
        if backs:  # else a forward-only loop (no gradient): GPipe it
            out.append(_region(graph, micro, F, graph.nodes[backs[0]], scans[f][1], M))
    if len(out) > 1:
        raise PipelineError(
            f"1F1B fuses one forward/backward loop pair; this step has {len(out)}. "
            "Use pipeline_schedule='gpipe'"
        )
    return tuple(out)


def _region(graph: Graph, micro: Graph, F: Node, B: Node, f_labels: ScanLabels, M: int) -> Fused:
    producer = graph.producer
    n_kf = F.params["num_carry"]
    ys = set(F.outputs[n_kf:])
    after_f, after_b = descendants(graph, F.id), descendants(graph, B.id)
    # a per-layer output the step keeps besides the backward's saved activations (a
    # dropout layer's updated rng count in an NNX model) is folded over the micro-batches
    # as GPipe folds it (`autopar.lower.pipeline.run_1f1b`)
    between = [n for n in graph.nodes if n.id in after_f - after_b - {F.id}]
    # what reads a per-layer result (not the saved activations the backward loop reads)
    # and leads nowhere into the backward loop runs after the pipeline, on the results
    # gathered over the micro-batches: the roll's slicing of them into the user's leaves
    into_b = ancestors(graph, B.id)
    reads_ys = set()
    for n in between:
        if any(v in ys or producer.get(v) in reads_ys for v in n.inputs):
            reads_ys.add(n.id)
    between = [n for n in between if n.id in into_b or n.id not in reads_ys]
    made = {v for n in between for v in n.outputs}
    ext = dict.fromkeys(
        v for n in between for v in n.inputs if v not in made and v not in graph.consts
    )

    def label(v: int) -> Label:
        if v in ys:
            raise PipelineError(
                f"1F1B: the loop at {F.key} hands its saved activations to "
                f"{graph.nodes[producer[v]].key} as well as to the backward loop; "
                "use pipeline_schedule='gpipe'"
            )
        if v in F.outputs:
            return f_labels.outs[F.outputs.index(v)]
        a, m = graph.values[v].shape, micro.values[v].shape
        diff = [d for d, (x, y) in enumerate(zip(a, m)) if x != y]
        if not diff:
            return SAME
        if len(diff) == 1 and a[diff[0]] == m[diff[0]] * M:
            return diff[0]
        raise PipelineError(f"1F1B: {graph.values[v]} does not cut into {M} micro-batches")

    ins = [(v, label(v)) for v in ext]
    specs = [
        Spec.replicated(graph.values[v].rank)
        if lab == SAME
        else split_spec(graph.values[v].rank, lab)
        for v, lab in ins
    ]
    sub = replace(graph, nodes=tuple(between), inputs=tuple(ext), outputs=())
    have, _ = separate(sub, specs, M, micro)
    head = [n for n in between if all(v in have for v in n.outputs)]
    head_ids = {n.id for n in head}
    read = {v for n in head for v in n.inputs}
    n_cb, n_kb = B.params["num_consts"], B.params["num_carry"]
    for i, v in enumerate(B.inputs):
        p = producer.get(v)
        if p is None or p not in after_f or p == F.id and v in ys:
            continue
        if p not in head_ids:
            raise PipelineError(
                f"1F1B: the backward loop at {B.key} reads {graph.values[v]} from "
                f"{graph.nodes[p].key}, which cannot run micro-batch by micro-batch; "
                "use pipeline_schedule='gpipe'"
            )
        if not n_cb <= i < n_cb + n_kb:
            raise PipelineError(
                f"1F1B: the backward loop at {B.key} reads {graph.values[v]} from the ops "
                "between the loops other than as its carry; use pipeline_schedule='gpipe'"
            )
    region = head_ids | {F.id, B.id}
    used_outside = {v for n in graph.nodes if n.id not in region for v in n.inputs}
    used_outside |= set(graph.outputs)
    outs = []
    for n in head:
        for v in n.outputs:
            if v not in used_outside:
                continue
            sp = have[v]
            if sp.partial:
                outs.append((v, SUM))
            elif sp.used_axes:
                outs.append((v, next(d for d, a in enumerate(sp.dims) if a)))
            else:
                raise PipelineError(
                    f"1F1B: {graph.values[v]} from {n.key} is the same for every "
                    "micro-batch; use pipeline_schedule='gpipe'"
                )
    consts = {
        v: graph.consts[v]
        if v in graph.consts and graph.values[v] == micro.values[v]
        else micro.consts[v]
        for n in head
        for v in n.inputs
        if v in micro.consts
    }
    return Fused(
        F.id,
        B.id,
        tuple(n.id for n in head),
        tuple((v, lab) for v, lab in ins if v in read),
        tuple(outs),
        tuple(micro.nodes[n.id] for n in head),
        consts,
        {v: micro.values[v] for v, _ in outs},
    )
