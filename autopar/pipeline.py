"""Pipeline parallelism over a `scan` of layers: configuration and micro-batch analysis.

A pipelined scan runs its `length` steps (layers) in `stages` groups, one per index of
the mesh's stage axis, each group on its own sub-mesh of the other axes; the batch is
cut into `microbatches` that flow through the stages (GPipe: every micro-batch's
forward scan, then, as a separate pipelined scan, every backward one). Each scan is
pipelined on its own, so a train step's forward and backward layer loops are two
pipelines, and the activations the forward loop saves stay on the stage that made
them (they are `ys` sliced per layer, split over the stage axis like the weights).

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

The labels are checked against the body (`_check_separable`, `autopar.microbatch`):
every op must run per micro-batch without communication, a batch-free output may only
come from a *sum* over the batch, and a body with batch statistics inside is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import jax

from autopar.errors import MeshError
from autopar.ir import Graph, Node
from autopar.microbatch import fits, separate, split_spec, sum_spec
from autopar.sharding import MeshInfo, Spec

SUM = "sum"
SAME = "same"
Label = int | str
SCHEDULES = ("gpipe",)


@dataclass(frozen=True)
class Pipeline:
    """How pipelined scans run: `stages` along mesh axis `axis`, `microbatches` per step."""

    stages: int
    microbatches: int
    schedule: str = "gpipe"
    axis: str = "stage"

    def to_json(self) -> dict:
        return {
            "stages": self.stages,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "axis": self.axis,
        }

    @staticmethod
    def from_json(d: dict) -> Pipeline:
        return Pipeline(int(d["stages"]), int(d["microbatches"]), d["schedule"], d["axis"])


@dataclass(frozen=True)
class ScanLabels:
    """Per input and output of a scan node: a batch dim (of the body's value), SUM or SAME."""

    ins: tuple[Label, ...]
    outs: tuple[Label, ...]


@dataclass(frozen=True)
class PipelinedScans:
    """What the lowering needs: the pipeline, and per pipelined scan node id its body at
    the micro-batch size with its labels."""

    pipe: Pipeline
    scans: Mapping[int, tuple[Graph, ScanLabels]]


def check_pipeline(pipe: Pipeline, mesh: MeshInfo) -> None:
    if pipe.schedule not in SCHEDULES:
        raise MeshError(
            f"pipeline schedule {pipe.schedule!r} is not implemented; choose one of {SCHEDULES}"
        )
    if pipe.axis not in mesh.axis_names or mesh.size(pipe.axis) != pipe.stages:
        raise MeshError(
            f"pipeline_stages={pipe.stages} needs a mesh axis {pipe.axis!r} of size {pipe.stages}; "
            f"the mesh is {mesh.shape}. Add it, e.g. mesh={{'{pipe.axis}': {pipe.stages}, "
            f"'data': ..., 'model': ...}}"
        )
    if pipe.microbatches < 1:
        raise MeshError(f"microbatches must be >= 1, got {pipe.microbatches}")


def pipelined_scans(graph: Graph, pipe: Pipeline) -> tuple[int, ...]:
    """Ids of the scan nodes that are pipelined: loops whose length the stage count
    divides and that carry a batched value."""
    return tuple(
        n.id
        for n in graph.nodes
        if n.body is not None
        and n.params["length"] % pipe.stages == 0
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


def micro_args(flat_args: Sequence, batch: int, microbatches: int, fn_name: str) -> list:
    """Abstract args at the micro-batch size: every leaf whose leading dim is the batch."""
    if batch % microbatches:
        raise MeshError(
            f"{fn_name}: the batch of {batch} does not split into {microbatches} micro-batches; "
            "pick a micro-batch count that divides it"
        )
    out = []
    for x in flat_args:
        shape = getattr(x, "shape", None)
        if shape and shape[0] == batch:
            x = jax.ShapeDtypeStruct((batch // microbatches, *shape[1:]), x.dtype)
        elif shape is not None:
            x = jax.ShapeDtypeStruct(shape, x.dtype)
        out.append(x)
    return out


def scan_labels(full: Node, micro: Node, microbatches: int, where: str) -> ScanLabels:
    """Label the loop's inputs and outputs by comparing the two captures' bodies."""
    fb, mb = full.body, micro.body
    if [n.op for n in fb.nodes] != [n.op for n in mb.nodes] or len(fb.values) != len(mb.values):
        raise MeshError(
            f"the scan at {where} is a different computation at the micro-batch size "
            f"({len(fb.nodes)} vs {len(mb.nodes)} ops); pipelining needs a loop body whose "
            "ops do not depend on the batch size"
        )

    def label(v_full: int, v_micro: int, what: str) -> Label:
        a, b = fb.values[v_full].shape, mb.values[v_micro].shape
        diff = [d for d, (x, y) in enumerate(zip(a, b)) if x != y]
        if not diff:
            return SAME
        if len(a) == len(b) and len(diff) == 1 and a[diff[0]] == b[diff[0]] * microbatches:
            return diff[0]
        raise MeshError(
            f"the scan at {where}: {what} is {list(a)} at the full batch but {list(b)} per "
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
        raise MeshError(
            f"the scan at {where} carries values that are not cut along the batch "
            f"(labels in {carry_in}, out {carry_out}); only a loop whose carry is the batched "
            "activation can be pipelined"
        )
    _check_separable(fb, mb, ins, outs, microbatches, where)
    return ScanLabels(ins, outs)


def _check_separable(
    body: Graph, micro_body: Graph, ins, outs, microbatches: int, where: str
) -> None:
    """Refuse a body that mixes micro-batches (e.g. a batch mean fed back into the
    activations), which would silently compute something else per micro-batch: every
    op must run per micro-batch (`autopar.microbatch.separate`), and the outputs must
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
        shown = ", ".join(f"{body.values[v]} {have.get(v, '?')}" for v in bad.inputs)
        raise MeshError(
            f"the scan at {where} cannot run micro-batch by micro-batch: its body's "
            f"{bad.op} at {bad.key} mixes the batch ({shown}); pipelining needs a loop "
            "whose steps treat every example separately (no batch statistics inside)"
        )
    for v, lab in zip(body.outputs, outs):
        want = spec(v, lab)
        got = have.get(v, Spec.replicated(body.values[v].rank))
        if got != want and not (lab != SUM and fits(want, got)):
            raise MeshError(
                f"the scan at {where}: a loop output {body.values[v]} comes out {got} per "
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


def layer_ranges(node: Node, pipe: Pipeline) -> list[tuple[int, int]]:
    k = stage_layers(node, pipe)
    return [(s * k, (s + 1) * k) for s in range(pipe.stages)]
