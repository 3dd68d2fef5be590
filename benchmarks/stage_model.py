"""The GPT shape model and its per-layer prices, for the stage search (`benchmarks.stages`).

A GPT (``autopar.examples.models.gpt``) is ``L`` identical layers plus a head (embedding,
final norm, tied logits and loss); :class:`GPTShape` holds its sizes.

**Per-layer prices** (:class:`LayerCosts`, :func:`price_gpt_layers`) come from autopar's
own cost model: autopar plans (``engine="dp"``, Megatron tensor-parallel specs pinned on
the parameters and the batch, :func:`megatron_specs`) of single-layer pieces of
``autopar.examples.models.gpt`` on the mesh ``{data: 1, model: t}`` at micro-batch ``b``, with
``L1`` = one layer and ``L0`` = no layer (embedding, final LayerNorm, logits, loss):

* ``fb_s  = grad(L1) - grad(L0)``, ``fwd_s = fwd(L1) - fwd(L0)`` (full recompute);
  ``selective_s``: the forward plan's compute time of the attention core ops;
* ``act_bytes``: the activations one layer keeps for its backward, the liveness peak of
  ``grad`` above its arguments, ``L1 - L0``; ``core_act_bytes`` of them produced by the
  attention core (values the core produces before the loss and uses after it, at the
  plan's specs); ``input_bytes``: the layer's input ``b s h`` (replicated over ``model``,
  Megatron without sequence parallelism), all that full remat keeps;
* ``param_bytes = args(grad L1) - args(grad L0)``, ``opt_bytes`` the optimizer state
  (``args(step) - args(grad)``), ``opt_s = (step - grad)(L1) - (step - grad)(L0)``;
* the head: ``grad(L0)``, its liveness peak, its parameters and optimizer state.

The stage search composes these into a stage's time and memory (`benchmarks.stages`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from autopar.cost.model import CostModel
from cost_models import ClusterProfile

# ---- the model ------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTShape:
    """A GPT (``autopar.examples.models.gpt``) as the stage search sees it; ``batch`` is global."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int
    dtype: Any = jnp.bfloat16

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))  # one spelling per dtype

    @staticmethod
    def from_config(cfg: Any, batch: int | None = None) -> GPTShape:
        """From a ``GPTConfig`` (``batch`` defaults to its ``batch_size``)."""
        return GPTShape(
            cfg.layers,
            cfg.hidden,
            cfg.heads,
            cfg.seq,
            cfg.vocab,
            cfg.batch_size if batch is None else batch,
            cfg.dtype,
        )

    @staticmethod
    def from_args(state: Any, batch: Any, heads: int) -> GPTShape:
        """From an ``autopar.examples.models.gpt`` train state and batch (arrays or
        ShapeDtypeStructs; layers unrolled ``h_<i>`` or stacked under ``nn.scan``).
        ``heads`` is not in the shapes: pass the model's."""
        params = state["params"]
        vocab, hidden = params["wte"]["embedding"].shape
        if "h" in params:  # scan_layers=True: params/h/block/... stacked [layers, ...]
            layers = params["h"]["block"]["ln_1"]["scale"].shape[0]
        else:
            layers = sum(1 for k in params if k.startswith("h_"))
        tokens = batch["inputs"]
        return GPTShape(
            layers,
            hidden,
            heads,
            tokens.shape[1],
            vocab,
            tokens.shape[0],
            params["wte"]["embedding"].dtype,
        )

    def config(self, layers: int, micro: int):
        """The ``GPTConfig`` of a ``layers``-layer piece at micro-batch ``micro``."""
        from autopar.examples.models import gpt

        return gpt.GPTConfig(
            vocab=self.vocab,
            seq=self.seq,
            hidden=self.hidden,
            layers=layers,
            heads=self.heads,
            dtype=self.dtype,
            batch_size=micro,
        )

    @property
    def flops(self) -> float:
        """Model FLOPs per step (no recompute), the numerator of MFU."""
        return model_flops(self.batch, self.seq, self.layers, self.hidden, self.vocab)


def model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Korthikanti'22: model FLOPs per step (no recompute), the numerator of MFU:
    ``72 B s l h^2 (1 + s / 6h + V / 12lh)`` (6 x params x tokens plus attention)."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 72.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))


# ---- pricing single-layer pieces with autopar -----------------------------------------


def param_path(path: str) -> str:
    """The parameter path below ``params/`` for params and their optimizer moments."""
    parts = path.split("/")
    if parts[0] == "params":
        return "/".join(parts[1:])
    if parts[0] == "opt_state" and len(parts) > 3 and parts[2] in ("mu", "nu"):
        return "/".join(parts[3:])
    return ""


def _split(shape: Sequence[int], dim: int, n: int) -> PartitionSpec:
    """``dim`` (negative: from the end) on ``model`` when ``n`` divides it, else replicated."""
    d = dim % len(shape) if shape else 0
    if not shape or shape[d] % n:
        return PartitionSpec()
    return PartitionSpec(*[("model" if i == d else None) for i in range(len(shape))])


def megatron_specs(args: tuple[Any, Any], mesh_shape: dict[str, int]) -> tuple[Any, Any]:
    """Megatron-LM's tensor-parallel layout of an ``autopar.examples.models.gpt`` train state and
    batch ``args = (state, batch)``: q/k/v/c_fc column-split on ``model``, o/c_proj
    kernels row-split, the token embedding vocab-split, the rest replicated (optimizer
    moments follow their parameter); the batch on ``data``. Returns PartitionSpec pytrees
    (the same layout as ``benchmarks.baselines``' ``megatron``)."""
    from autopar.ir.capture import path_str

    state, batch = args
    n = mesh_shape.get("model", 1)

    def state_spec(path, x):
        pp = param_path(path_str(path))
        parts = pp.split("/")
        if not pp or len(parts) < 2:
            return PartitionSpec()
        owner, leaf = parts[-2], parts[-1]
        if owner in ("q", "k", "v", "c_fc"):
            return _split(x.shape, -1, n)
        if owner in ("o", "c_proj") and leaf == "kernel":
            return _split(x.shape, -2, n)
        if owner == "wte" and leaf == "embedding":
            return _split(x.shape, 0, n)
        return PartitionSpec()

    def batch_spec(path, x):
        d = mesh_shape.get("data", 1)
        if not x.shape or x.shape[0] % d:
            return PartitionSpec()
        return PartitionSpec("data", *[None] * (len(x.shape) - 1))

    return (
        jax.tree_util.tree_map_with_path(state_spec, state),
        jax.tree_util.tree_map_with_path(batch_spec, batch),
    )


SpecsFn = Callable[[tuple[Any, Any], dict[str, int]], tuple[Any, Any]]


def _piece_fns(cfg):
    """(train step, loss(params, batch), value_and_grad(params, batch), state, batch)."""
    from autopar.examples.models import gpt

    ts = gpt.make_train_step(cfg)
    state, batch = gpt.abstract_args(cfg)

    def loss(params, batch):
        return ts.loss({"params": params}, batch)

    def grad(params, batch):
        return jax.value_and_grad(loss)(params, batch)

    return ts, loss, grad, state, batch


def piece_plans(cfg: Any, tp: int, profile: ClusterProfile, specs: SpecsFn = megatron_specs):
    """autopar plans of ``grad`` (loss and its gradient), ``fwd`` (the loss) and ``step``
    (the AdamW train step) of the GPT ``cfg`` on the mesh ``{data: 1, model: tp}``, with
    ``specs(args, mesh)`` pinned on the state and batch and ``engine="dp"`` completing
    every other tensor's sharding."""
    import autopar

    ts, loss, grad, state, batch = _piece_fns(cfg)
    mesh = {"data": 1, "model": tp}
    state_specs, batch_specs = specs((state, batch), mesh)

    def plan(fn, args, in_specs):
        par = autopar.parallelize(fn, mesh=mesh, cluster=profile, engine="dp", in_specs=in_specs)
        return par.plan(*args)

    pargs, pspecs = (state["params"], batch), (state_specs["params"], batch_specs)
    return {
        "grad": plan(grad, pargs, pspecs),
        "fwd": plan(loss, pargs, pspecs),
        "step": plan(ts.step, (state, batch), (state_specs, batch_specs)),
    }


@functools.cache
def attention_core_lines() -> tuple[str, int, int]:
    """(file name, first line, last line) of ``gpt.SelfAttention``'s core: QK^T .. AV."""
    from autopar.examples.models import gpt

    lines, start = inspect.getsourcelines(gpt.SelfAttention.__call__)
    first = next(i for i, t in enumerate(lines) if '"bqhd,bkhd->bhqk"' in t)
    last = next(i for i, t in enumerate(lines) if '"bhqk,bkhd->bqhd"' in t)
    return Path(inspect.getsourcefile(gpt.SelfAttention)).name, start + first, start + last


def in_attention_core(source: str) -> bool:
    """Whether an op's source line (``file:line``) lies in the attention core."""
    fname, lo, hi = attention_core_lines()
    name, _, line = source.rpartition(":")
    return Path(name).name == fname and line.isdigit() and lo <= int(line) <= hi


@dataclass(frozen=True)
class LayerCosts:
    """Per-device prices of one layer and of the head, per micro-batch, at one
    (tensor-parallel size ``tp``, micro-batch size ``micro``). Seconds and bytes."""

    tp: int
    micro: int
    fb_s: float  # one layer forward + backward
    fwd_s: float  # one layer forward (the full-remat recompute)
    selective_s: float  # the attention core's forward (the selective-remat recompute)
    act_bytes: float  # activations one layer keeps for its backward
    core_act_bytes: float  # of which produced by the attention core
    input_bytes: float  # one layer's input (what full remat keeps)
    work_bytes: float  # backward working set above the kept activations (once per stage)
    param_bytes: float  # one layer's parameters (gradients: the same)
    opt_bytes: float  # one layer's optimizer state
    opt_s: float  # one layer's optimizer update
    head_fb_s: float  # embedding + final norm + logits + loss, forward + backward
    head_act_bytes: float  # activations the head keeps for its backward
    head_param_bytes: float
    head_opt_bytes: float
    head_opt_s: float
    send_bytes: float  # the activation one stage sends the next per micro-batch

    def recompute_s(self, remat: str) -> float:
        return {"none": 0.0, "selective": self.selective_s, "full": self.fwd_s}[remat]

    def saved_bytes(self, remat: str) -> float:
        """Activations one layer keeps per micro-batch in flight."""
        return {
            "none": self.act_bytes,
            "selective": self.act_bytes - self.core_act_bytes,
            "full": self.input_bytes,
        }[remat]

    def working_bytes(self, remat: str) -> float:
        """Live once per stage during a backward: the backward working set plus, under
        remat, one layer's recomputed activations."""
        extra = {"none": 0.0, "selective": self.core_act_bytes, "full": self.act_bytes}[remat]
        return self.work_bytes + extra


LayerPricer = Callable[[int, int], LayerCosts]  # (tp, micro) -> LayerCosts


def residual_bytes(plan, fn: Callable, args: Sequence[Any]) -> tuple[float, float]:
    """(all, attention core) bytes per device of the values ``fn = value_and_grad(...)``
    keeps for its backward: produced before the loss and used after it, at the plan's
    output specs (``plan`` is autopar's plan of ``fn`` on ``args``)."""
    from autopar.ir.capture import capture

    g = capture(fn, args)
    turn = next(n.id for n in g.nodes if g.outputs[0] in n.outputs)
    last_use: dict[int, int] = {}
    for n in g.nodes:
        for x in n.inputs:
            last_use[x] = n.id
    total = core = 0.0
    for n, rec in zip(g.nodes, plan.ops):
        if n.id > turn:
            break
        for v, spec in zip(n.outputs, rec.out_specs):
            if last_use.get(v, -1) > turn:
                b = g.values[v].nbytes // spec.shards(plan.mesh)
                total += b
                core += b if in_attention_core(n.source) else 0
    return float(total), float(core)


def price_gpt_layers(
    shape: GPTShape, tp: int, micro: int, profile: ClusterProfile, specs: SpecsFn = megatron_specs
) -> LayerCosts:
    """:class:`LayerCosts` of ``shape``'s layer and head at (``tp``, ``micro``) from
    autopar plans of single-layer pieces (see the module docstring)."""
    p1 = piece_plans(shape.config(1, micro), tp, profile, specs)
    p0 = piece_plans(shape.config(0, micro), tp, profile, specs)
    s = {k: (p1[k].cost.step_s, p0[k].cost.step_s) for k in p1}
    args = {k: (p1[k].cost.argument_bytes, p0[k].cost.argument_bytes) for k in p1}
    kept = []  # (all, core) activations kept for the backward, L1 and L0
    for layers, plans in ((1, p1), (0, p0)):
        _, _, grad, state, batch = _piece_fns(shape.config(layers, micro))
        kept.append(residual_bytes(plans["grad"], grad, (state["params"], batch)))
    peak1 = p1["grad"].cost.peak_memory_bytes - args["grad"][0]
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(batch))
    act = micro * shape.seq * shape.hidden * jnp.dtype(shape.dtype).itemsize
    param = args["grad"][0] - args["grad"][1]
    return LayerCosts(
        tp=tp,
        micro=micro,
        fb_s=s["grad"][0] - s["grad"][1],
        fwd_s=s["fwd"][0] - s["fwd"][1],
        selective_s=sum(o.compute_s for o in p1["fwd"].ops if in_attention_core(o.source)),
        act_bytes=kept[0][0] - kept[1][0],
        core_act_bytes=kept[0][1] - kept[1][1],
        input_bytes=float(act),
        work_bytes=max(0.0, peak1 - kept[0][0]),
        param_bytes=float(param),
        opt_bytes=float(args["step"][0] - args["step"][1] - param),
        opt_s=(s["step"][0] - s["grad"][0]) - (s["step"][1] - s["grad"][1]),
        head_fb_s=s["grad"][1],
        head_act_bytes=kept[1][0],
        head_param_bytes=float(args["grad"][1] - batch_bytes),
        head_opt_bytes=float(args["step"][1] - args["grad"][1]),
        head_opt_s=s["step"][1] - s["grad"][1],
        send_bytes=float(act),
    )


def gpt_pricer(shape: GPTShape, profile: ClusterProfile, specs: SpecsFn = megatron_specs):
    """A memoized :data:`LayerPricer` for ``shape`` (one set of plans per (tp, micro))."""
    return functools.cache(lambda tp, micro: price_gpt_layers(shape, tp, micro, profile, specs))


def p2p_seconds(cm: CostModel, send_bytes: float, tp: int) -> float:
    """Megatron's scatter/gather stage-to-stage send per micro-batch, forward activation
    and backward gradient: ``2 (permute(bytes / tp) on pipe + all-gather(bytes) on model)``."""
    if cm.mesh.size("pipe") <= 1:
        return 0.0
    return 2 * (
        cm.collective("collective-permute", ("pipe",), send_bytes / tp).seconds
        + cm.collective("all-gather", ("model",), send_bytes).seconds
    )


# ---- the stage DP ---------------------------------------------------------------------
