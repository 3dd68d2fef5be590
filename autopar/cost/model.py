"""The cost model: seconds and bytes from a cluster profile.

compute     max(flops / (peak x efficiency), bytes / (HBM bw x efficiency)) per device
collective  latency + factor(n) x bytes / (link bw x efficiency), with nccl-tests'
            bus-bandwidth factors: all-reduce 2(n-1)/n, all-gather, reduce-scatter
            and all-to-all (n-1)/n. `bytes` is the full-size per-device buffer
            (all-reduce: the buffer; all-gather: the result; reduce-scatter: the
            input; all-to-all: the buffer), the same convention `autopar.tools.hlo` reads.
            Several mesh axes at once use the slowest link among them. An all-to-all
            also copies what it receives into place in HBM (`ALL_TO_ALL_COPIES`).
reshard     the collectives that turn one Spec into another (`reshard`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from autopar.ir.chunks import CHUNK_OPS
from autopar.ir.graph import Graph, Node, TensorType
from autopar.ir.ops import CONTRACTIONS
from autopar.sharding import Axes, MeshInfo, Spec
from autopar.strategies.elementwise import ELEMENTWISE
from cost_models import ClusterProfile

BUS_FACTOR = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


@dataclass(frozen=True)
class Collective:
    kind: str
    axes: Axes
    bytes: int  # full-size per-device buffer, see module docstring
    seconds: float


@dataclass(frozen=True)
class Reshard:
    seconds: float
    collectives: tuple[Collective, ...]


NO_RESHARD = Reshard(0.0, ())


# XLA's all-reduce combiner merges independent all-reduces over the same devices into
# one collective of up to 30 MiB and 256 operands (the GPU defaults, e.g.
# xla_gpu_all_reduce_combine_threshold_bytes): the gradient all-reduces of data
# parallelism become a few large ones, each paying the latency once. XLA:GPU combines
# all-gathers and reduce-scatters too, but XLA:CPU does not (an FSDP step keeps one per
# parameter), and compiled CPU programs are what the prediction is checked against, so
# those keep a latency each.
COMBINABLE = frozenset({"all-reduce"})

# An all-to-all sends contiguous chunks, one per peer, cut along the dim it splits, and
# the chunks it receives land stacked along that dim, where the value wants them along
# the dim it concatenates: the received buffer is copied into place once (read and
# written: 2x its bytes of HBM traffic), at the HBM roofline, beside the link time; the
# cut before it fuses into the op that makes the value. Compiled on XLA:CPU, the
# hidden-sharded embedding of a BERT step had a transpose or concatenate of twice its
# bytes after each all-to-all (and slice fusions before it that re-read their operands
# per chunk); without the copy the search took that embedding's all-to-alls for cheaper
# than the gradient all-reduce they replace.
ALL_TO_ALL_COPIES = 2
COMBINE_THRESHOLD_BYTES = 30 * 2**20
COMBINE_THRESHOLD_COUNT = 256


class CostModel:
    """Prices ops and reshards on one mesh with one cluster profile (memoized)."""

    def __init__(self, profile: ClusterProfile, mesh: MeshInfo):
        self.profile = profile
        self.mesh = mesh
        self._link: dict[Axes, tuple[float, float]] = {}

    def link(self, axes: Axes) -> tuple[float, float]:
        """(latency s, effective bandwidth B/s) of the slowest link `axes` cross."""
        if axes not in self._link:
            p = self.profile
            if self.mesh.is_intra_node(axes):
                self._link[axes] = (p.intra_latency, p.intra_bandwidth * p.intra_link_efficiency)
            else:
                self._link[axes] = (p.inter_latency, p.inter_bandwidth * p.inter_link_efficiency)
        return self._link[axes]

    def collective(self, kind: str, axes: Axes, nbytes: float, copies: bool = True) -> Collective:
        """`kind` over `axes` moving `nbytes` (module docstring); with `copies`, an
        all-to-all's HBM copies too (a compiled program has them as kernels of its own:
        its pricing passes False)."""
        n = math.prod(self.mesh.size(a) for a in axes)
        if n <= 1:
            return Collective(kind, axes, int(nbytes), 0.0)
        latency, bw = self.link(axes)
        seconds = latency + BUS_FACTOR[kind](n) * nbytes / bw
        if copies:
            seconds += self.local_copy_seconds(kind) * nbytes
        return Collective(kind, axes, int(nbytes), seconds)

    def local_copy_seconds(self, kind: str) -> float:
        """Seconds per byte of a collective's copies in HBM (all-to-all only)."""
        if kind != "all-to-all":
            return 0.0
        return ALL_TO_ALL_COPIES / (self.profile.hbm_bandwidth * self.profile.hbm_efficiency)

    def bucketed(self, c: Collective, share: float) -> float:
        """Seconds of `c` when XLA's combiner merges it with its peers (`COMBINABLE`
        kinds only): its bytes at full bandwidth, and of the bucket's one latency the
        larger of its byte share (bytes / threshold) and `share`, its share among the
        values that can join the bucket (see docs/algorithms.md, "Bucketed latency")."""
        if c.kind not in COMBINABLE or c.seconds <= 0:
            return c.seconds
        latency = self.link(c.axes)[0]
        return c.seconds - latency * (1.0 - min(1.0, max(c.bytes / COMBINE_THRESHOLD_BYTES, share)))

    def compute_seconds(self, flops: float, nbytes: float, dtype) -> float:
        p = self.profile
        return max(
            flops / (p.flops_for(dtype) * p.compute_efficiency),
            nbytes / (p.hbm_bandwidth * p.hbm_efficiency),
        )

    def local_bytes(self, t: TensorType, spec: Spec) -> int:
        return t.nbytes // spec.shards(self.mesh) if t.rank else t.nbytes

    @functools.cache  # noqa: B019 - one CostModel per search
    def reshard(self, t: TensorType, src: Spec, dst: Spec) -> Reshard:
        """Cheapest collective sequence (in this simple model) from `src` to `dst`: the
        `reshard_steps`, each moving the local bytes of `t` in its layout."""
        colls = tuple(
            self.collective(kind, axes, self.local_bytes(t, layout))
            for kind, axes, layout in reshard_steps(src, dst)
        )
        return Reshard(sum(c.seconds for c in colls), colls) if colls else NO_RESHARD


@functools.lru_cache(maxsize=1 << 18)  # shared by every mesh, bounded in size
def reshard_steps(src: Spec, dst: Spec) -> tuple[tuple[str, Axes, Spec], ...]:
    """The collectives from `src` to `dst`, for a value of any size: (kind, axes, the
    layout whose local bytes it moves). What a step costs depends on the value only
    through its bytes, so whole strategy tables are priced from these at once
    (`autopar.cost.tables`).

    A Partial `dst` other than `src` is reached by first summing `src` into
    `dst`'s dims; splitting a whole value into summands is local (one device per
    group keeps it, the others hold zeros). A scalar's specs differ only in their
    pending sums."""
    if src == dst:
        return ()
    if dst.partial:
        return reshard_steps(src, dst.without_partial())
    steps: list[tuple[str, Axes, Spec]] = []
    dst_axis_dim = dst.axis_dims()
    # 1. Pending sums: reduce-scatter onto a dim `dst` shards with that axis, else
    # all-reduce (`Spec.summed_into`, the layout the lowering sums into).
    dims = src.summed_into(dst).dims if src.partial else src.dims
    if src.partial:
        scattered = {a for d in dims for a in d} - set(src.used_axes)
        scatter = tuple(a for a in src.partial if a in scattered)
        reduce = tuple(a for a in src.partial if a not in scattered)
        cur = src.without_partial()
        if reduce:
            steps.append(("all-reduce", reduce, cur))
        if scatter:
            steps.append(("reduce-scatter", scatter, cur))
    # 2. Axes that sit where `dst` does not want them: move (all-to-all) or gather.
    gather: list[str] = []
    moved: list[str] = []
    for d, want in zip(dims, dst.dims):
        keep = 0
        while keep < len(d) and keep < len(want) and d[keep] == want[keep]:
            keep += 1
        for a in d[keep:]:
            (moved if a in dst_axis_dim else gather).append(a)
    cur = Spec(dims)  # after the sums
    moves = cur.move_steps(dst) if moved else None
    if moves:  # as the lowering does it: slices first, then one axis per all-to-all
        for prev, nxt in zip((cur, *moves), moves):
            for d, now in zip(prev.dims, nxt.dims):  # the axis that left its dim (if any)
                steps += [("all-to-all", (a,), prev) for a in d if a not in now]
    else:
        steps += _reorder_steps(cur, dst)
    # 3. Axes `dst` adds are a local slice: free. The lowering slices them before it
    # gathers (`Spec.gather_last`), so the all-gather makes `dst`'s blocks.
    if gather:
        steps.append(("all-gather", tuple(gather), dst))
    return tuple(steps)


def _reorder_steps(cur: Spec, dst: Spec) -> list[tuple[str, Axes, Spec]]:
    """The collectives XLA uses to reach `cur.gather_last(dst)` (where the lowering
    stops before its all-gather) where no one-axis-at-a-time path exists
    (`Spec.move_steps` is None, or no axis moves): one all-to-all over the axes that
    leave their dims for others, and, where an axis that stays on its dim changes its
    place there (`S[data,model]` to `S[model]`, to `S[model,data]`, an axis leaving
    from in front of one that stays, or one sliced in front of it: `S[data]` to
    `S[model]` passes through `S[model,data]`), a collective-permute of the whole local
    block over the dim's axes from the first misplaced one on, before and after: the
    block a device holds belongs on another device. Seen in XLA's SPMD partitioner on
    2 x 4 and 4 x 4 meshes
    (`tests/test_pricing_rules.py::test_reorders_priced_as_xla_compiles_them`);
    `S[data,model]` to `S[model]` was priced as an all-to-all over `model` alone, within a
    node, where XLA sends every block across the mesh (MoE-10B's plan, 4 ms more
    communication compiled than predicted)."""
    goal = cur.gather_last(dst)
    leave: list[str] = []
    permute: list[str] = []
    for c, g in zip(cur.dims, goal.dims):
        leave += [a for a in c if a not in g]
        k = 0
        while k < len(c) and k < len(g) and c[k] == g[k]:
            k += 1
        if any(a in g for a in c[k:]):  # an axis that stays moves within its dim
            permute = list(dict.fromkeys((*permute, *c[k:], *g[k:])))
    steps: list[tuple[str, Axes, Spec]] = []
    if leave:
        steps.append(("all-to-all", tuple(leave), cur))
    if permute:
        steps.append(("collective-permute", tuple(permute), cur))
    return steps


# Ops XLA fuses with their neighbours into one kernel: elementwise math and the shape
# ops around it (see `search.facts.hbm_traffic` for how their HBM traffic is priced).
FUSED_OPS = (
    frozenset(ELEMENTWISE)
    | frozenset(CHUNK_OPS)
    | {
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "iota",
        "slice",
        "concatenate",
        "stack",
        "unstack",
        "pad",
        "rev",
    }
)


def compute_dtype(node: Node, graph: Graph) -> np.dtype:
    """The dtype a node computes in: for a contraction its operands' (bfloat16 operands
    accumulating into float32 compute in bfloat16), else its first result's. The FLOP
    rate also depends on the matmul precision: see `rate_dtype`."""
    if node.op in CONTRACTIONS:
        return np.dtype(jnp.promote_types(*(graph.values[v].dtype for v in node.inputs)))
    return graph.values[node.outputs[0]].dtype if node.outputs else np.dtype(np.float32)


# What a float32 contraction runs at, by precision (XLA on NVIDIA GPUs): DEFAULT and HIGH
# use TF32 tensor cores (HIGH is bf16_3x on TPU; on GPU XLA runs it as TF32, and pricing it
# at the tfloat32 rate is within ~1.5x of three bf16 passes either way); HIGHEST is true
# float32. `jax_default_matmul_precision` names: see `_CONFIG_PRECISION`.
_F32_RATE = {"DEFAULT": "tfloat32", "HIGH": "tfloat32", "HIGHEST": "float32"}
_CONFIG_PRECISION = {
    "highest": "float32",
    "float32": "float32",
    "high": "tfloat32",
    "tensorfloat32": "tfloat32",
    "bfloat16_3x": "tfloat32",
    "default": "tfloat32",
    "fastest": "tfloat32",
    "bfloat16": "bfloat16",
}


def default_f32_rate() -> str:
    """The rate name a float32 contraction with no precision of its own runs at, by
    `jax_default_matmul_precision` (TF32 unless it asks for float32 or bfloat16)."""
    import jax

    name = jax.config.jax_default_matmul_precision
    return "tfloat32" if name is None else _CONFIG_PRECISION.get(str(name).lower(), "tfloat32")


def _f32_rate(precision) -> str:
    """The rate name a float32 contraction with this `precision` param runs at."""
    if precision is None:
        return default_f32_rate()
    if not isinstance(precision, tuple | list):
        precision = (precision,)
    names = [getattr(p, "name", str(p)).upper() for p in precision if p is not None]
    presets = [n for n in names if n not in _F32_RATE]  # a DotAlgorithmPreset
    if presets:
        n = presets[0]
        if n.startswith("F32") or n.startswith("F64") or n.endswith("_X6") or n.endswith("_X9"):
            return "float32"
        if n.startswith("TF32") or n.endswith("_X3"):
            return "tfloat32"
        if n.startswith("BF16"):
            return "bfloat16"
        if n.startswith("F16"):
            return "float16"
        return default_f32_rate()
    if not names or all(n == "DEFAULT" for n in names):
        return default_f32_rate()
    rank = ["DEFAULT", "HIGH", "HIGHEST"]
    return _F32_RATE[max(names, key=rank.index)]  # the higher operand precision wins


def rate_dtype(node: Node, graph: Graph, profile: ClusterProfile) -> str | np.dtype:
    """The dtype name whose peak (`profile.flops_for`) prices `node`'s FLOPs: its
    `compute_dtype`, except that a float32 contraction runs at the rate its precision
    picks (the op's `precision` param, else `jax_default_matmul_precision`): TF32 by
    default on profiles with a `tfloat32` peak, float32 under HIGHEST / "highest"."""
    dtype = compute_dtype(node, graph)
    if node.op not in CONTRACTIONS or dtype != np.float32:
        return dtype
    rate = _f32_rate(node.params.get("precision"))
    return rate if rate in profile.peak_flops else dtype


def matmul_rates(graph: Graph, profile: ClusterProfile) -> dict[str, str]:
    """Which peak each contraction dtype of `graph` is priced at, for the plan to record:
    e.g. ``{"float32 dots": "tfloat32 (494.7 TFLOP/s)"}``. Nested graphs (scan bodies,
    cond branches) are included."""
    out: dict[str, str] = {}

    def visit(g: Graph) -> None:
        for n in g.nodes:
            if n.op in CONTRACTIONS:
                dtype = compute_dtype(n, g)
                rate = rate_dtype(n, g, profile)
                name = getattr(rate, "name", rate)
                tflops = profile.flops_for(rate) / 1e12
                out.setdefault(f"{dtype.name} dots", f"{name} ({tflops:.4g} TFLOP/s)")
            for sub in _nested_graphs(n):
                visit(sub)

    visit(graph)
    return dict(sorted(out.items()))


def _nested_graphs(node: Node) -> list[Graph]:
    return [g for g in (node.body, *(node.branches or ())) if g is not None]


def node_flops(node: Node, graph: Graph) -> float:
    """Total (unsharded) FLOPs of a node."""
    outs = [graph.values[v] for v in node.outputs]
    if node.op == "dot_general":
        lhs = graph.values[node.inputs[0]]
        (lc, _), _ = node.params["dimension_numbers"]
        return 2.0 * outs[0].size * math.prod(lhs.shape[a] for a in lc)
    if node.op == "conv_general_dilated":
        rhs = graph.values[node.inputs[1]]
        o = rhs.shape[node.params["dimension_numbers"].rhs_spec[0]]
        # Input-gradient convs dilate the input with zeros; those products are not work.
        dilation = math.prod(node.params.get("lhs_dilation") or (1,))
        return 2.0 * outs[0].size * rhs.size / max(o, 1) / dilation
    ins = [graph.values[v].size for v in node.inputs]
    return float(max([t.size for t in outs] + ins + [1]))


@dataclass(frozen=True)
class Cost:
    compute_s: float
    comm_s: float
    peak_memory_bytes: int
    argument_bytes: int
    comm_bytes: dict[str, int] = field(default_factory=dict)  # "kind@axes" -> bytes

    @property
    def step_s(self) -> float:
        """No-overlap step time: compute plus communication."""
        return self.compute_s + self.comm_s

    def to_json(self) -> dict:
        return {
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "step_s": self.step_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "argument_bytes": self.argument_bytes,
            "comm_bytes": dict(sorted(self.comm_bytes.items())),
        }

    @staticmethod
    def from_json(d: dict) -> Cost:
        return Cost(
            d["compute_s"],
            d["comm_s"],
            int(d["peak_memory_bytes"]),
            int(d.get("argument_bytes", 0)),
            dict(d.get("comm_bytes", {})),
        )
