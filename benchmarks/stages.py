"""Inter-operator (pipeline) stage search: Alpa's stage DP over a stack of identical layers.

The model is a sequence of ``L`` identical layers plus a head (embedding, final norm,
tied logits and loss). :func:`search_stages` chooses, for ``D`` devices:

* ``S`` pipeline stages (``S`` divides ``D``), each on a sub-mesh of ``D / S`` devices
  factored ``data x model`` with the model (tensor-parallel) axis inside a node of the
  profile (``model`` divides ``devices_per_node``): mesh ``{pipe: S, data, model}``,
  row-major, so ``model`` runs on NVLink and ``data`` / ``pipe`` cross nodes once the
  sub-mesh is larger than a node;
* the micro-batch size ``b`` and so the micro-batch count ``M = B / (data x b)``;
* the schedule: ``1f1b`` (stage ``i`` of ``S`` keeps ``min(M, S - i)`` micro-batches of
  activations in flight) or ``gpipe`` (all ``M``);
* a ZeRO stage for the stage's data axis: 1 shards optimizer state, 2 also gradients,
  3 also parameters;
* per stage, its layer range and its rematerialization: ``none``, ``selective`` (the
  attention core, QK^T .. softmax .. AV, recomputed) or ``full`` (every layer recomputed
  from its input);

minimizing the predicted step time subject to per-device memory <= budget.

**Per-layer prices** (:class:`LayerCosts`, :func:`price_gpt_layers`) come from autopar's
own cost model, plans of single-layer pieces of the GPT: ``benchmarks.stage_model``.


A stage's prices are then composed (per device; ``n`` layers, ``d`` = data size):

* time per micro-batch: ``n (fb_s + recompute) + head (last stage) + p2p`` where p2p is
  Megatron's scatter/gather send of the activation and its gradient,
  ``2 (permute(b s h / t) on pipe + all-gather(b s h) on model)``; ZeRO-2 adds a
  reduce-scatter of each layer's gradient per micro-batch (only a 1/d shard is kept),
  ZeRO-3 also all-gathers each layer's parameters in the forward, the backward and (full
  remat) the recompute;
* end of step: the gradient collective over ``data`` (ZeRO-0 all-reduce; ZeRO-1
  reduce-scatter + all-gather of the updated parameters; ZeRO-2 the all-gather; ZeRO-3
  nothing) and the AdamW update (divided by ``d`` from ZeRO-1 on);
* memory: parameters, gradients (same bytes), optimizer state, each divided by ``d``
  where ZeRO shards it (ZeRO-3 adds two layers' gathered parameters, ZeRO-2/3 one layer's
  unsharded gradient), plus activations: in-flight micro-batches x (``n`` x saved bytes
  per layer (+ the head's on the last stage)) + one layer's recomputed activations as
  working space under remat. The first and the last stage both hold the (tied)
  embedding, as Megatron does.

Step time ``= (M + S - 1) max_i t_i + max_i end_i`` (non-interleaved pipeline, bubble
included, no overlap of communication with compute, as autopar's ``step_s``).

**The DP** (:func:`stage_dp`): for a fixed global choice (``S``, sub-mesh, ``b``,
schedule, ZeRO) each stage ``i`` with ``n`` layers has a time per micro-batch per remat,
a memory fit per remat and an end-of-step time. Alpa's enumeration of the bottleneck
bound ``T`` (ascending, from the smallest feasible one found by bisection, pruned when
``(M + S - 1) T`` plus the smallest possible end term cannot win) with, per ``T``, a DP
over (stage, layers left) minimizing the largest end term over stages whose time fits
under ``T``. Exact: equal to brute force over every split and remat (tests check this).

**Entry points**: :func:`search_gpt` (a :class:`GPTShape`, from a ``GPTConfig`` or from
the train state and batch) and :func:`search_stages` (any model, given a
:data:`LayerPricer`); :func:`evaluate` prices one fixed choice. ``SearchSpace(even=True)``
keeps every stage at ``L / S`` layers (for a lowering that splits a scan evenly).

Not modelled: interleaved schedules, sequence parallelism, overlap of communication with
compute, the tied-embedding all-reduce between the first and last stage, the first
stage's embedding lookup time, uneven last micro-batches, fp32 master weights (autopar's
AdamW keeps moments in the parameter dtype), allocator fragmentation and framework
reserves (the budget is the whole HBM unless told otherwise).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from autopar.cost.model import CostModel
from autopar.sharding import MeshInfo
from benchmarks.stage_model import (
    GPTShape,
    LayerCosts,
    LayerPricer,
    gpt_pricer,
    # benchmarks.published and .baselines import these from here too
    in_attention_core,  # noqa: F401
    model_flops,  # noqa: F401
    p2p_seconds,
    param_path,  # noqa: F401
    piece_plans,  # noqa: F401
)
from cost_models import ClusterProfile

REMATS = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class DPResult:
    objective: float  # factor x max stage time + max end term
    layers: tuple[int, ...]  # per stage
    remat: tuple[int, ...]  # per stage, index into the remat axis
    bottleneck_s: float  # max stage time
    end_s: float  # max end term


def _split_dp(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """g[i, l]: min over splits of ``l`` layers into stages i.. of max ``cost[i, n_i]``
    (``cost[i, 0] = inf``: every stage has a layer); arg[i, l]: stage i's ``n``."""
    S, L1 = cost.shape
    rem = np.arange(L1)[:, None]
    n = np.arange(L1)[None, :]
    idx = rem - n
    valid = idx >= 0
    g = np.full((S + 1, L1), np.inf)
    g[S, 0] = 0.0
    arg = np.zeros((S, L1), dtype=int)
    for i in range(S - 1, -1, -1):
        nxt = np.where(valid, g[i + 1][np.clip(idx, 0, None)], np.inf)
        m = np.maximum(cost[i][None, :], nxt)
        arg[i] = np.argmin(m, axis=1)  # first (fewest layers) on ties
        g[i] = m[np.arange(L1), arg[i]]
    return g, arg


def stage_dp(
    time_s: np.ndarray, fits: np.ndarray, end_s: np.ndarray, factor: float
) -> DPResult | None:
    """Split ``L`` layers into ``S`` stages (each >= 1 layer) and pick a remat per stage.

    ``time_s[i, r, n]``: stage ``i``'s seconds per micro-batch with ``n`` layers under
    remat ``r``; ``fits[i, r, n]``: its memory fits; ``end_s[i, n]``: its end-of-step
    seconds. Minimizes ``factor x max_i time + max_i end``; ``None`` if nothing fits.
    Column ``n = 0`` is ignored. Exact (see the module docstring)."""
    t = np.where(fits, time_s, np.inf)
    t[:, :, 0] = np.inf
    r_best = np.argmin(t, axis=1)  # the fastest remat that fits (the first on ties)
    tmin = np.take_along_axis(t, r_best[:, None, :], axis=1)[:, 0, :]
    S, L1 = tmin.shape
    L = L1 - 1
    bounds = np.unique(tmin[np.isfinite(tmin)])

    def solve(T: float):
        g, arg = _split_dp(np.where(tmin <= T, end_s, np.inf))
        return (g, arg) if np.isfinite(g[0, L]) else None

    if bounds.size == 0 or solve(bounds[-1]) is None:
        return None
    lo, hi = 0, len(bounds) - 1  # smallest feasible bound by bisection
    while lo < hi:
        mid = (lo + hi) // 2
        if solve(bounds[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    end_floor = solve(bounds[-1])[0][0, L]
    best: DPResult | None = None
    for T in bounds[lo:]:
        if best is not None and factor * T + end_floor >= best.objective:
            break
        g, arg = solve(T)
        ns, left = [], L
        for i in range(S):
            ns.append(int(arg[i, left]))
            left -= ns[-1]
        bott = max(float(tmin[i, n]) for i, n in enumerate(ns))
        end = max(float(end_s[i, n]) for i, n in enumerate(ns))
        obj = factor * bott + end
        if best is None or obj < best.objective:
            rs = tuple(int(r_best[i, n]) for i, n in enumerate(ns))
            best = DPResult(obj, tuple(ns), rs, bott, end)
    return best


# ---- composing a stage ----------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The global choices of a pipeline plan."""

    stages: int
    data: int  # per-stage sub-mesh: data x model
    model: int
    micro_batch: int  # sequences per micro-batch per data replica
    micro_batches: int  # M
    schedule: str
    zero: int


@dataclass(frozen=True)
class Memory:
    """Per-device bytes of one stage."""

    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class _Collectives:
    """Per-call seconds of the stage's collectives: alpha + bytes x beta."""

    alpha: dict[str, float]
    beta: dict[str, float]

    def __call__(self, kind: str, nbytes: Any) -> Any:
        return self.alpha[kind] + self.beta[kind] * nbytes if self.beta[kind] else 0 * nbytes


def _collectives(cm: CostModel) -> _Collectives:
    alpha, beta = {}, {}
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
        a = cm.collective(kind, ("data",), 0.0).seconds
        alpha[kind], beta[kind] = a, (cm.collective(kind, ("data",), 1e9).seconds - a) / 1e9
    return _Collectives(alpha, beta)


def mesh_of(cfg: Config, profile: ClusterProfile) -> MeshInfo:
    """The mesh ``{pipe, data, model}`` (row-major: ``model`` innermost, inside a node)."""
    return MeshInfo.build(
        ("pipe", "data", "model"),
        (cfg.stages, cfg.data, cfg.model),
        None,
        profile.devices_per_node,
    )


def inflight(cfg: Config, i: int) -> int:
    """Micro-batches whose activations stage ``i`` holds at once."""
    return min(cfg.micro_batches, cfg.stages - i) if cfg.schedule == "1f1b" else cfg.micro_batches


def _holds_embedding(cfg: Config, i: int) -> bool:
    return i in (0, cfg.stages - 1)


def stage_time(c: LayerCosts, cfg: Config, i: int, n: Any, remat: str, cm: CostModel) -> Any:
    """Seconds per micro-batch of stage ``i`` with ``n`` layers (``n`` may be an array)."""
    coll = _collectives(cm)
    last, emb = i == cfg.stages - 1, _holds_embedding(cfg, i)
    t = n * (c.fb_s + c.recompute_s(remat)) + (c.head_fb_s if last else 0.0)
    t = t + p2p_seconds(cm, c.send_bytes, cfg.model)
    if cfg.zero >= 2 and cfg.data > 1:  # each micro-batch's gradient reduce-scattered
        t = t + n * coll("reduce-scatter", c.param_bytes)
        t = t + (coll("reduce-scatter", c.head_param_bytes) if emb else 0.0)
    if cfg.zero == 3 and cfg.data > 1:  # parameters gathered in fwd, bwd (and recompute)
        gathers = 3 if remat == "full" else 2
        t = t + n * gathers * coll("all-gather", c.param_bytes)
        t = t + (2 * coll("all-gather", c.head_param_bytes) if emb else 0.0)
    return t


def stage_end(c: LayerCosts, cfg: Config, i: int, n: Any, cm: CostModel) -> Any:
    """End-of-step seconds of stage ``i``: gradient collective and optimizer update."""
    coll = _collectives(cm)
    emb = _holds_embedding(cfg, i)
    p = n * c.param_bytes + (c.head_param_bytes if emb else 0.0)
    opt = n * c.opt_s + (c.head_opt_s if emb else 0.0)
    if cfg.zero == 0:
        return coll("all-reduce", p) + opt
    opt = opt / cfg.data
    if cfg.zero == 1:
        return coll("reduce-scatter", p) + coll("all-gather", p) + opt
    if cfg.zero == 2:
        return coll("all-gather", p) + opt
    return opt + 0 * p


def stage_memory(c: LayerCosts, cfg: Config, i: int, n: Any, remat: str) -> Memory:
    """Per-device memory of stage ``i`` with ``n`` layers (fields may be arrays)."""
    last, emb, d = i == cfg.stages - 1, _holds_embedding(cfg, i), cfg.data
    p = n * c.param_bytes + (c.head_param_bytes if emb else 0.0)
    o = n * c.opt_bytes + (c.head_opt_bytes if emb else 0.0)
    params = p / d + 2 * c.param_bytes if cfg.zero == 3 else p
    grads = p / d + c.param_bytes if cfg.zero >= 2 else p
    opt = o / d if cfg.zero >= 1 else o
    k = inflight(cfg, i)
    acts = k * (n * c.saved_bytes(remat) + (c.head_act_bytes if last else 0.0))
    acts = acts + c.working_bytes(remat)
    return Memory(params, grads, opt, acts)


# ---- plans and the search -------------------------------------------------------------


@dataclass(frozen=True)
class StepTerms:
    """The step time's terms (seconds), at the bottleneck stage."""

    bottleneck_s: float  # seconds per micro-batch of the slowest stage
    pipeline_s: float  # M x bottleneck
    bubble_s: float  # (S - 1) x bottleneck
    p2p_s: float  # (M + S - 1) x the send per micro-batch (inside the two above)
    end_s: float  # the slowest stage's gradient collective + optimizer


@dataclass(frozen=True)
class Candidate:
    """One global choice and its best split (``layers`` empty when nothing fits)."""

    config: Config
    layers: tuple[int, ...]
    remat: tuple[str, ...]
    step_s: float
    memory_bytes: float  # the largest stage's per-device memory

    @property
    def fits(self) -> bool:
        return bool(self.layers)

    def row(self) -> dict:
        return {
            **asdict(self.config),
            "layers": list(self.layers),
            "remat": list(self.remat),
            "step_s": self.step_s,
            "memory_gb": self.memory_bytes / 1e9,
        }


@dataclass(frozen=True)
class StagePlan:
    """A pipeline plan and its predicted cost."""

    config: Config
    stages: tuple[tuple[int, int], ...]  # layer range [start, stop) per stage
    remat: tuple[str, ...]  # per stage
    step_s: float
    terms: StepTerms
    memory: Memory  # the stage with the most per-device memory
    memory_by_stage: tuple[float, ...]  # bytes per device
    mfu: float
    devices: int
    candidates: tuple[Candidate, ...] = ()
    search_seconds: float = field(default=0.0, compare=False)

    @property
    def submesh(self) -> tuple[int, int]:
        """(data, model) of each stage."""
        return self.config.data, self.config.model

    @property
    def memory_bytes(self) -> float:
        return self.memory.total

    def table(self) -> list[dict]:
        """Every candidate evaluated, one row each (``layers`` empty: nothing fits)."""
        return [c.row() for c in self.candidates]

    def summary(self) -> dict:
        c = self.config
        return {
            **asdict(c),
            "submesh": list(self.submesh),
            "stages_layers": [list(s) for s in self.stages],
            "remat": list(self.remat),
            "step_s": self.step_s,
            "terms": asdict(self.terms),
            "memory_gb": {k: v / 1e9 for k, v in asdict(self.memory).items()}
            | {"total": self.memory.total / 1e9},
            "memory_by_stage_gb": [m / 1e9 for m in self.memory_by_stage],
            "mfu": self.mfu,
        }


def _tables(c: LayerCosts, cfg: Config, L: int, cm: CostModel, budget: float, remats):
    """time_s[i, r, n], fits[i, r, n], end_s[i, n] of every stage for :func:`stage_dp`."""
    n = np.arange(L + 1, dtype=float)
    S = cfg.stages
    t = np.empty((S, len(remats), L + 1))
    fits = np.empty((S, len(remats), L + 1), dtype=bool)
    end = np.empty((S, L + 1))
    for i in range(S):
        end[i] = stage_end(c, cfg, i, n, cm)
        for j, r in enumerate(remats):
            t[i, j] = stage_time(c, cfg, i, n, r, cm)
            fits[i, j] = stage_memory(c, cfg, i, n, r).total <= budget
    return t, fits, end


def evaluate(
    c: LayerCosts,
    cfg: Config,
    layers: Sequence[int],
    remat: Sequence[str],
    profile: ClusterProfile,
    flops: float,
) -> StagePlan:
    """The :class:`StagePlan` of one fully fixed choice (memory not checked)."""
    cm = CostModel(profile, mesh_of(cfg, profile))
    times = [stage_time(c, cfg, i, n, r, cm) for i, (n, r) in enumerate(zip(layers, remat))]
    ends = [stage_end(c, cfg, i, n, cm) for i, n in enumerate(layers)]
    mems = [stage_memory(c, cfg, i, n, r) for i, (n, r) in enumerate(zip(layers, remat))]
    bott, end = float(max(times)), float(max(ends))
    M, S = cfg.micro_batches, cfg.stages
    step = (M + S - 1) * bott + end
    starts = np.concatenate([[0], np.cumsum(layers)]).astype(int)
    worst = max(range(S), key=lambda i: float(mems[i].total))
    devices = S * cfg.data * cfg.model
    mem = Memory(*(float(x) for x in asdict(mems[worst]).values()))
    return StagePlan(
        config=cfg,
        stages=tuple((int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])),
        remat=tuple(remat),
        step_s=step,
        terms=StepTerms(
            bott,
            M * bott,
            (S - 1) * bott,
            (M + S - 1) * p2p_seconds(cm, c.send_bytes, cfg.model),
            end,
        ),
        memory=mem,
        memory_by_stage=tuple(float(m.total) for m in mems),
        mfu=flops / (step * devices * profile.flops_for("bfloat16")),
        devices=devices,
    )


@dataclass(frozen=True)
class SearchSpace:
    """What :func:`search_stages` enumerates (``None``: every value that applies)."""

    stages: tuple[int, ...] | None = None
    model: tuple[int, ...] | None = None  # tensor-parallel sizes (default: divide a node)
    micro_batch: tuple[int, ...] = (1, 2, 4)
    schedules: tuple[str, ...] = SCHEDULES
    zero: tuple[int, ...] = ZERO_STAGES
    remat: tuple[str, ...] = REMATS
    even: bool = False  # every stage gets layers / S layers (S must divide layers)


def configs(
    layers: int, batch: int, devices: int, devices_per_node: int, space: SearchSpace
) -> list[Config]:
    """Every global choice: ``S | devices`` with ``S <= layers``, ``model | node`` and
    ``model | devices / S``, ``data x micro_batch | batch``; sorted, so deterministic."""
    out = []
    stages = space.stages or tuple(s for s in range(1, layers + 1) if devices % s == 0)
    tps = space.model or tuple(
        t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0
    )
    for S in sorted(stages):
        if devices % S or layers < S:
            continue
        for t in sorted(tps):
            if (devices // S) % t:
                continue
            d = devices // S // t
            for b in sorted(space.micro_batch):
                if batch % (d * b):
                    continue
                for sched in space.schedules:
                    for z in sorted(space.zero):
                        out.append(Config(S, d, t, b, batch // (d * b), sched, z))
    return out


def search_stages(
    pricer: LayerPricer,
    *,
    layers: int,
    batch: int,
    devices: int,
    profile: ClusterProfile,
    flops: float,
    memory_budget: float | None = None,
    space: SearchSpace = SearchSpace(),  # noqa: B008 - frozen
) -> StagePlan:
    """The fastest pipeline plan that fits ``memory_budget`` bytes per device (default:
    the profile's HBM) for ``layers`` identical layers, a global ``batch`` and
    ``devices`` devices. ``pricer(tp, micro)`` gives the :class:`LayerCosts`;
    ``flops`` is the model's FLOPs per step (for MFU). Raises ``ValueError`` if no
    choice fits. Every global choice evaluated is in the plan's ``candidates``."""
    t0 = time.perf_counter()
    budget = profile.hbm_bytes if memory_budget is None else float(memory_budget)
    cands: list[Candidate] = []
    best: tuple[float, int, StagePlan] | None = None
    for k, cfg in enumerate(configs(layers, batch, devices, profile.devices_per_node, space)):
        c = pricer(cfg.model, cfg.micro_batch)
        cm = CostModel(profile, mesh_of(cfg, profile))
        t, fits, end = _tables(c, cfg, layers, cm, budget, space.remat)
        if space.even:  # only the even split may fit
            fits[:, :, np.arange(layers + 1) * cfg.stages != layers] = False
        res = stage_dp(t, fits, end, cfg.micro_batches + cfg.stages - 1)
        if res is None:
            cands.append(Candidate(cfg, (), (), math.inf, math.inf))
            continue
        remat = tuple(space.remat[r] for r in res.remat)
        plan = evaluate(c, cfg, res.layers, remat, profile, flops)
        cands.append(Candidate(cfg, res.layers, remat, plan.step_s, plan.memory_bytes))
        if best is None or plan.step_s < best[0]:
            best = (plan.step_s, k, plan)
    if best is None:
        raise ValueError(
            f"no pipeline plan fits {budget / 1e9:.1f} GB per device on {devices} devices; "
            "raise memory_budget, add devices or widen the search space"
        )
    return _with(best[2], tuple(cands), time.perf_counter() - t0)


def _with(plan: StagePlan, cands: tuple[Candidate, ...], seconds: float) -> StagePlan:
    return replace(plan, candidates=cands, search_seconds=seconds)


def search_gpt(
    shape: GPTShape,
    devices: int,
    profile: ClusterProfile,
    *,
    memory_budget: float | None = None,
    space: SearchSpace = SearchSpace(),  # noqa: B008 - frozen
    pricer: LayerPricer | None = None,
) -> StagePlan:
    """:func:`search_stages` for an ``autopar.examples.models.gpt`` model, layers priced by
    :func:`gpt_pricer` unless ``pricer`` is given (pass one to reuse its cache)."""
    return search_stages(
        pricer or gpt_pricer(shape, profile),
        layers=shape.layers,
        batch=shape.batch,
        devices=devices,
        profile=profile,
        flops=shape.flops,
        memory_budget=memory_budget,
        space=space,
    )
