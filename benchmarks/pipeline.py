"""Pipeline-stage search for GPT-3 175B on 1024 A100s: ``python -m benchmarks.pipeline``.

GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048, vocab 51200, global batch
1536, bf16, AdamW) on 1024 devices with the ``a100-80g`` profile, 80 GB per device.

* ``auto``: :func:`benchmarks.stages.search_gpt` over stages, per-stage
  ``data x model`` sub-mesh (tensor parallel inside a node), micro-batch size 1/2/4,
  1F1B / GPipe, per-stage remat none / selective / full and ZeRO 0-3 (the terms and
  the DP: the module docstrings of ``benchmarks/stages.py`` and ``stage_model.py``);
* ``megatron``: the Megatron-LM configuration (TP 8 x PP 8 x DP 16, 1F1B, micro-batch
  1, 12 layers per stage) with full and with selective recompute, priced by the same
  cost model (:func:`benchmarks.stages.evaluate`) with the same optimizer-state options
  ``auto`` has: the fastest of ZeRO 0-3 that fits the budget (Megatron-LM's distributed
  optimizer is ZeRO-1); ``megatron_zero0`` keeps the plain, no-ZeRO configuration;
* the same under the efficiency factors ``benchmarks.published`` fitted to the published
  step times (``compute+hbm``, read from ``results/published.json``), when present;
* a plot of per-device memory against step time over remat x ZeRO (every global choice,
  uniform remat, no budget): ``results/pipeline_memory_time.png``.

Writes ``results/pipeline.json`` and ``results/pipeline.md``. Search seconds are
measured twice: cold (pricing the layer pieces with autopar: one set of plans per
(tensor-parallel size, micro-batch size)) and warm (the DP alone, prices cached).
``--from-json`` re-renders the Markdown and the plot from a saved JSON.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autopar  # noqa: E402
import cost_models  # noqa: E402
from benchmarks import published  # noqa: E402
from benchmarks import stage_model as SM  # noqa: E402
from benchmarks import stages as PL  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GPT3 = SM.GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)
DEVICES = 1024
MEGATRON = PL.Config(
    stages=8, data=16, model=8, micro_batch=1, micro_batches=96, schedule="1f1b", zero=0
)
# Megatron's 1024-GPU GPT-3 175B run as shared/BENCHMARKS.md gives it (batch 1536, TP 8):
# ~140 TFLOP/s per GPU, which Megatron counts with its eq. (3) (recompute forward included).
MEGATRON_TFLOPS = 140.0


def published_reference() -> dict:
    """The published 175B runs as step times and model-FLOPs utilization (72 formula)."""
    s = GPT3
    flops3 = published.megatron_flops(s.batch, s.seq, s.layers, s.hidden, s.vocab)
    step = flops3 / (MEGATRON_TFLOPS * 1e12 * DEVICES)
    k = next(a for a in published.ANCHORS if a.name == "korthikanti-175B")
    kf = SM.model_flops(k.batch, k.seq, k.layers, k.hidden, k.vocab)
    return {
        "megatron_sc21_1024gpu": {
            "tflops_per_gpu_eq3": MEGATRON_TFLOPS,
            "hardware_utilization": MEGATRON_TFLOPS * 1e12 / published.A100_BF16_PEAK,
            "step_s": step,
            "mfu_72_formula": GPT3.flops / (step * DEVICES * published.A100_BF16_PEAK),
        },
        "korthikanti22_64gpu": {
            "step_s": k.step_s,
            "mfu_72_formula": kf / (k.step_s * k.gpus * published.A100_BF16_PEAK),
        },
    }


def korthikanti_activation_bytes(tp: int, micro: int) -> float:
    """Korthikanti'22 eq. (2)-(3): one layer's activations, no recompute, no sequence
    parallelism: ``s b h (10 + 24 / t + 5 a s / (h t))`` bytes (for comparison only)."""
    s, h, a = GPT3.seq, GPT3.hidden, GPT3.heads
    return s * micro * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def _fitted_profile(prof):
    path = RESULTS / "published.json"
    if not path.exists():
        return None, None
    eff = json.loads(path.read_text())["fits"]["compute+hbm"]["efficiency"]
    return published.with_factors(prof, **eff), eff


def _megatron(pricer, prof, remat: str, zero: int = 0) -> PL.StagePlan:
    cfg = dataclasses.replace(MEGATRON, zero=zero)
    c = pricer(cfg.model, cfg.micro_batch)
    layers = (GPT3.layers // cfg.stages,) * cfg.stages
    return PL.evaluate(c, cfg, layers, (remat,) * cfg.stages, prof, GPT3.flops)


def _megatron_best(pricer, prof, remat: str) -> PL.StagePlan:
    """Megatron's configuration with the ZeRO options `auto` searches (`PL.ZERO_STAGES`):
    the fastest that fits the profile's memory, else the one needing the least."""
    plans = [_megatron(pricer, prof, remat, z) for z in PL.ZERO_STAGES]
    fitting = [p for p in plans if p.memory_bytes <= prof.hbm_bytes]
    if fitting:
        return min(fitting, key=lambda p: p.step_s)
    return min(plans, key=lambda p: p.memory_bytes)


def _megatrons(pricer, prof) -> dict:
    return {
        "megatron": {r: _megatron_best(pricer, prof, r).summary() for r in ("full", "selective")},
        "megatron_zero0": {r: _megatron(pricer, prof, r).summary() for r in ("full", "selective")},
    }


def _sweep_row(row: dict, remat: str) -> dict:
    """A plot point: the global choice, step and memory (no per-stage lists)."""
    return {k: v for k, v in row.items() if k not in ("layers", "remat")} | {"uniform_remat": remat}


def _sweep(pricer, prof) -> list[dict]:
    """Every global choice's fastest split under each uniform remat x ZeRO, no budget."""
    rows = []
    for remat in PL.REMATS:
        for zero in PL.ZERO_STAGES:
            space = PL.SearchSpace(remat=(remat,), zero=(zero,))
            plan = PL.search_gpt(
                GPT3, DEVICES, prof, memory_budget=math.inf, space=space, pricer=pricer
            )
            rows += [_sweep_row(c.row(), remat) for c in plan.candidates if c.fits]
    return rows


def run(profile_name: str = "a100-80g") -> dict:
    prof = cost_models.load(profile_name)
    pricer = SM.gpt_pricer(GPT3, prof)
    t0 = time.perf_counter()
    auto = PL.search_gpt(GPT3, DEVICES, prof, pricer=pricer)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = PL.search_gpt(GPT3, DEVICES, prof, pricer=pricer)
    warm = time.perf_counter() - t0
    out = {
        "model": dataclasses.asdict(GPT3) | {"dtype": "bfloat16"},
        "devices": DEVICES,
        "profile": profile_name,
        "memory_budget_gb": prof.hbm_bytes / 1e9,
        "search": {
            "cold_s": cold,
            "warm_s": warm,
            "deterministic": again == auto,
            "candidates": len(auto.candidates),
            "candidates_fitting": sum(c.fits for c in auto.candidates),
            "pricings": len({(c.config.model, c.config.micro_batch) for c in auto.candidates}),
        },
        "auto": auto.summary(),
        **_megatrons(pricer, prof),
        "layer_costs": {
            f"tp{tp}_b{b}": dataclasses.asdict(pricer(tp, b))
            | {"korthikanti_act_bytes": korthikanti_activation_bytes(tp, b)}
            for tp, b in sorted({(c.config.model, c.config.micro_batch) for c in auto.candidates})
        },
        "published": published_reference(),
        "top": [
            c.row()
            for c in sorted((c for c in auto.candidates if c.fits), key=lambda c: c.step_s)[:10]
        ],
        "sweep": _sweep(pricer, prof),
        "parallelize": parallelize_auto(profile_name, remat="auto"),
        "parallelize_gpipe": parallelize_auto(profile_name, remat="full", schedule="gpipe"),
        "jax": jax.__version__,
    }
    fitted, eff = _fitted_profile(prof)
    if fitted is not None:
        fpricer = SM.gpt_pricer(GPT3, fitted)
        fa = PL.search_gpt(GPT3, DEVICES, fitted, pricer=fpricer)
        out["fitted"] = {
            "efficiency": eff,
            "auto": fa.summary(),
            **_megatrons(fpricer, fitted),
        }
    return out


def gpt3_step(scan_layers: bool = True):
    """The GPT-3 175B train step (`GPT3`, bfloat16; layers under `nn.scan` or unrolled
    in Python) and its abstract arguments: (train step, args)."""
    from autopar.examples.models import gpt

    cfg = gpt.GPTConfig(
        vocab=GPT3.vocab,
        seq=GPT3.seq,
        hidden=GPT3.hidden,
        layers=GPT3.layers,
        heads=GPT3.heads,
        dtype=jnp.bfloat16,
        batch_size=GPT3.batch,
        scan_layers=scan_layers,
    )
    return gpt.make_train_step(cfg), gpt.abstract_args(cfg)


def parallelize_auto(
    profile_name: str,
    remat: str = "dots",
    engine: str = "dp",
    schedule: str | None = None,
    scan_layers: bool = True,
    donate: bool = False,
) -> dict:
    """The captured GPT-3 175B train step (layers under `nn.scan`, or unrolled in Python
    with `scan_layers=False`) planned by
    `autopar.parallelize(mesh=1024, pipeline_stages="auto", remat=...)` on abstract
    arguments: every stage count, its micro-batch counts and the layer plan at the
    micro-batch size searched for real. 1F1B by default (a stage keeps at most 2S - 1
    micro-batches' activations, so selective remat fits); GPipe keeps all M, so only
    full remat fits there. `donate`: the train state donated (`donate_argnums=0`, as a
    training loop passes it), so the updated state is written into its buffers."""
    ts, args = gpt3_step(scan_layers)
    t0 = time.perf_counter()
    step = autopar.parallelize(
        ts.step,
        mesh=DEVICES,
        cluster=profile_name,
        pipeline_stages="auto",
        pipeline_schedule=schedule,
        remat=remat,
        engine=engine,
        donate_argnums=(0,) if donate else (),
    )
    plan = step.plan(*args)
    seconds = time.perf_counter() - t0
    flops = SM.model_flops(GPT3.batch, GPT3.seq, GPT3.layers, GPT3.hidden, GPT3.vocab)
    peak = cost_models.load(profile_name).flops_for(jnp.bfloat16)
    return {
        "remat": plan.remat or "none",
        "remat_asked": remat,
        "remat_tried": next((w for w in plan.warnings if w.startswith("remat='auto'")), None),
        "engine": plan.engine,
        "mesh": plan.mesh.shape,
        "pipeline": {k: v for k, v in (plan.pipeline or {}).items() if k != "scans"},
        "step_s": plan.cost.step_s,
        "compute_s": plan.cost.compute_s,
        "comm_s": plan.cost.comm_s,
        "memory_gb": plan.cost.peak_memory_bytes / 1e9,
        "mfu": flops / (plan.cost.step_s * DEVICES * peak),
        "search_seconds": seconds,
        "tried": [w for w in plan.warnings if w.startswith("pipeline_stages=")],
        "skipped": next((w for w in plan.warnings if "tries not searched" in w), None),
    }


def _gb(x: float) -> str:
    return f"{x:.1f}"


def _plan_row(name: str, p: dict, budget_gb: float) -> str:
    stages = p["stages_layers"]
    per = sorted({b - a for a, b in stages})
    remat = ", ".join(f"{r} x{p['remat'].count(r)}" for r in PL.REMATS if r in p["remat"])
    fits = "yes" if p["memory_gb"]["total"] <= budget_gb else "**no**"
    return (
        f"| {name} | {p['stages']} | {p['data']} x {p['model']} | "
        f"{'/'.join(map(str, per))} | {p['micro_batch']} | {p['micro_batches']} | "
        f"{p['schedule']} | {remat} | {p['zero']} | {p['step_s']:.2f} | "
        f"{_gb(p['memory_gb']['total'])} ({fits}) | {p['mfu'] * 100:.1f} |"
    )


def markdown(r: dict) -> str:
    budget = r["memory_budget_gb"]
    pub = r["published"]
    m = r["model"]
    head = (
        "| plan | S | sub-mesh data x model | layers/stage | b | M | schedule | remat "
        "(stages) | ZeRO | step s | memory GB/device (fits) | MFU % |"
    )
    rule = "|---|---:|---|---|---:|---:|---|---|---:|---:|---|---:|"
    out = [
        "# Pipeline-stage search: GPT-3 175B on 1024 A100 80 GB",
        "",
        "Generated by `python -m benchmarks.pipeline` (terms and DP: the docstring of "
        "`autopar/search/stages.py`). Model: "
        f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, seq {m['seq']}, "
        f"vocab {m['vocab']}, batch {m['batch']}, bf16, AdamW; {r['devices']} devices, "
        f"profile `{r['profile']}`, budget {budget:.0f} GB per device. "
        "MFU = 72 B s l h^2 (1 + s/6h + V/12lh) / (step x devices x 312 TFLOP/s).",
        "",
        "## Profile defaults",
        "",
        head,
        rule,
        _plan_row("auto", r["auto"], budget),
        _plan_row("Megatron, full recompute", r["megatron"]["full"], budget),
        _plan_row("Megatron, selective recompute", r["megatron"]["selective"], budget),
        *(
            _plan_row(f"Megatron, {k} recompute, no ZeRO", r["megatron_zero0"][k], budget)
            for k in ("full", "selective")
            if "megatron_zero0" in r
        ),
    ]
    if "parallelize" in r:
        out += [
            "",
            "## The captured step, planned and priced by `autopar.parallelize`",
            "",
            "Not the stage search above: the real train step (layers under `nn.scan`) planned by "
            f'`parallelize(mesh={r["devices"]}, cluster="{r["profile"]}", pipeline_stages="auto", '
            'remat=..., engine="dp")` on abstract arguments. Every stage count S dividing the '
            "devices (mesh `{stage: S, data, model: 8}`) and its micro-batch counts (S to 12S) is "
            "searched op by op: one layer's plan at the micro-batch size on a stage's sub-mesh, "
            "the pipelined loops priced at M + S - 1 forward and backward slots, everything else "
            "on the whole mesh. 1F1B (the default) keeps at most 2S - 1 micro-batches' "
            'activations on a stage; its row is `remat="auto"`, which tries none, dots, '
            "selective and full and keeps the fastest plan that fits. The second row asks for "
            "GPipe with full remat (GPipe keeps all M micro-batches' activations); "
            '`pipeline_stages="auto"` includes S = 1, and a schedule of `none` means the '
            "unpipelined plan was the fastest that fit.",
            "",
            "| schedule | remat | mesh | M | engine | step s (compute + comm) | GB/device | MFU | "
            "search s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key in ("parallelize", "parallelize_gpipe"):
            if key not in r:
                continue
            a = r[key]
            pipe = a["pipeline"] or {}
            mesh = " x ".join(f"{k} {v}" for k, v in a["mesh"].items())
            out.append(
                f"| {pipe.get('schedule', 'none')} | {a['remat']} | {mesh} | "
                f"{pipe.get('microbatches', '-')} | {a['engine']} | {a['step_s']:.2f} "
                f"({a['compute_s']:.2f} + {a['comm_s']:.2f}) | {a['memory_gb']:.1f} | "
                f"**{100 * a['mfu']:.1f} %** | {a['search_seconds']:.0f} |"
            )
        mega = pub["megatron_sc21_1024gpu"]
        out += [
            "",
            "Megatron's 1024-GPU run as `shared/BENCHMARKS.md` gives it (about 140 TFLOP/s a "
            f"GPU): {mega['step_s']:.1f} s, {100 * mega['mfu_72_formula']:.1f} % by the same "
            "formula. "
            + (
                '`remat="auto"` (1F1B row) '
                + r["parallelize"]["remat_tried"].removeprefix("remat='auto' ")
                + ". "
                if r["parallelize"].get("remat_tried")
                else ""
            )
            + "What `parallelize` tried (1F1B row, the chosen remat): "
            + (
                r["parallelize"]["tried"][0].split(": ", 1)[-1][:1500]
                if r["parallelize"]["tried"]
                else "-"
            )
            + (f" ({r['parallelize']['skipped']})" if r["parallelize"].get("skipped") else ""),
        ]
    if "fitted" in r:
        f = r["fitted"]
        eff = ", ".join(f"`{k}` {v:.3g}" for k, v in f["efficiency"].items())
        out += [
            "",
            "## Efficiency factors fitted to the published step times",
            "",
            f"`benchmarks.published`'s `compute+hbm` fit ({eff}); layers re-priced.",
            "",
            head,
            rule,
            _plan_row("auto", f["auto"], budget),
            _plan_row("Megatron, full recompute", f["megatron"]["full"], budget),
            _plan_row("Megatron, selective recompute", f["megatron"]["selective"], budget),
            *(
                _plan_row(f"Megatron, {k} recompute, no ZeRO", f["megatron_zero0"][k], budget)
                for k in ("full", "selective")
                if "megatron_zero0" in f
            ),
        ]
    ms, ks = pub["megatron_sc21_1024gpu"], pub["korthikanti22_64gpu"]
    out += [
        "",
        "Published: the ~140 TFLOP/s per GPU that `shared/BENCHMARKS.md` gives for "
        "Megatron's 1024-GPU GPT-3 175B run (batch 1536, TP 8), counted with Megatron's eq. (3) "
        f"(which includes the recompute forward): {ms['hardware_utilization'] * 100:.1f} % of "
        f"peak, {ms['step_s']:.1f} s per step, MFU {ms['mfu_72_formula'] * 100:.1f} % by the "
        "formula above; Korthikanti'22 175B on "
        f"64 GPUs (selective recompute + sequence parallel): MFU {ks['mfu_72_formula'] * 100:.1f} %.",
        "",
    ]
    a = r["auto"]
    t = a["terms"]
    mem = a["memory_gb"]
    out += [
        "## The auto plan's terms",
        "",
        f"* per micro-batch on the bottleneck stage: {t['bottleneck_s'] * 1e3:.1f} ms; "
        f"pipeline (M x that) {t['pipeline_s']:.2f} s, bubble ((S - 1) x that) "
        f"{t['bubble_s']:.2f} s, of which stage-to-stage sends {t['p2p_s']:.3f} s; "
        f"end of step (gradient collective + optimizer) {t['end_s']:.3f} s;",
        f"* memory of its fullest stage: parameters {_gb(mem['params'])} GB, gradients "
        f"{_gb(mem['grads'])} GB, optimizer state {_gb(mem['optimizer'])} GB, activations "
        f"{_gb(mem['activations'])} GB; per stage: "
        + ", ".join(_gb(x) for x in a["memory_by_stage_gb"])
        + " GB.",
        "",
        "Search: "
        f"{r['search']['candidates']} global choices (stages x sub-mesh x micro-batch x "
        f"schedule x ZeRO), {r['search']['candidates_fitting']} fit; "
        f"{r['search']['cold_s']:.1f} s cold (pricing {r['search']['pricings']} "
        f"(tensor-parallel, micro-batch) pairs with autopar, six plans each) and "
        f"{r['search']['warm_s']:.1f} s warm (the DP alone); deterministic: "
        f"{r['search']['deterministic']}.",
        "",
        "Fastest fitting choices:",
        "",
        "| S | data x model | b | M | schedule | ZeRO | layers | remat | step s | GB |",
        "|---:|---|---:|---:|---|---:|---|---|---:|---:|",
    ]
    for c in r["top"]:
        remat = ", ".join(f"{x} x{c['remat'].count(x)}" for x in PL.REMATS if x in c["remat"])
        layers = "/".join(map(str, sorted(set(c["layers"]))))
        out.append(
            f"| {c['stages']} | {c['data']} x {c['model']} | {c['micro_batch']} | "
            f"{c['micro_batches']} | {c['schedule']} | {c['zero']} | {layers} | {remat} | "
            f"{c['step_s']:.2f} | {c['memory_gb']:.1f} |"
        )
    out += [
        "",
        "## Per-layer prices from autopar (per device, per micro-batch)",
        "",
        "| tp, b | fwd+bwd ms | fwd ms | attention core fwd ms | kept activations MB "
        "(attention core) | Korthikanti MB | backward working set MB | params MB | "
        "optimizer MB | head fwd+bwd ms |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in r["layer_costs"].values():
        out.append(
            f"| {c['tp']}, {c['micro']} | {c['fb_s'] * 1e3:.2f} | {c['fwd_s'] * 1e3:.2f} | "
            f"{c['selective_s'] * 1e3:.2f} | {c['act_bytes'] / 1e6:.0f} "
            f"({c['core_act_bytes'] / 1e6:.0f}) | {c['korthikanti_act_bytes'] / 1e6:.0f} | "
            f"{c['work_bytes'] / 1e6:.0f} | {c['param_bytes'] / 1e6:.0f} | "
            f"{c['opt_bytes'] / 1e6:.0f} | {c['head_fb_s'] * 1e3:.2f} |"
        )
    out += [
        "",
        "Kept activations are what autopar's liveness keeps from before the loss to "
        "after it at the plan's specs, layer minus head; the Korthikanti column "
        "(s b h (10 + 24/t + 5as/ht) bytes, no sequence parallelism; it counts dropout masks this "
        "model does not have) is for comparison. "
        "autopar counts every value of the jaxpr (the float32 softmax and LayerNorm "
        "intermediates included), where a fused GPU kernel would not keep them all.",
        "",
        "![memory against step time](pipeline_memory_time.png)",
        "",
        "`pipeline_memory_time.png`: every global choice's fastest split under one uniform "
        "remat and one ZeRO stage, with no memory budget; the dashed line is the 80 GB "
        "budget.",
        "",
        "## How each term is computed",
        "",
        "* Layer and head times, kept activations, parameter and optimizer-state bytes: "
        'autopar plans (`engine="dp"`, Megatron specs pinned) of a 1-layer and a 0-layer '
        "GPT at the micro-batch size on `{data: 1, model: t}`, differenced (the same pieces "
        "as `benchmarks.published`).",
        "* Recompute: full = one more layer forward; selective = the forward of the "
        "attention core (QK^T, mask, softmax, AV).",
        "* Stage time per micro-batch: layers x (fwd+bwd + recompute) + head (last stage) + "
        "stage-to-stage send (Megatron scatter/gather, both directions); ZeRO-2 adds a "
        "reduce-scatter of each layer's gradient per micro-batch, ZeRO-3 also all-gathers "
        "each layer's parameters in forward, backward and full recompute.",
        "* Step: (M + S - 1) x the slowest stage + the slowest stage's gradient collective "
        "over `data` and AdamW update (ZeRO-0 all-reduce; ZeRO-1 reduce-scatter + "
        "all-gather; ZeRO-2 all-gather; ZeRO-3 none; update / data from ZeRO-1).",
        "* Memory per device: parameters + gradients + optimizer state (ZeRO divides them "
        "by `data`; ZeRO-3 keeps two gathered layers, ZeRO-2/3 one unsharded layer "
        "gradient) + in-flight micro-batches x kept activations + one backward working set "
        "(+ one recomputed layer under remat). 1F1B: stage i of S keeps min(M, S - i) "
        "micro-batches, GPipe all M. First and last stages hold the tied embedding.",
        "",
        "## Not modelled",
        "",
        "* Interleaved schedules, sequence parallelism, and any overlap of communication with "
        "compute (autopar's step is compute + communication).",
        "* The first/last-stage all-reduce of the tied embedding gradient; the first stage's "
        "embedding lookup time.",
        "* fp32 master weights and fp32 Adam moments (autopar's AdamW keeps its moments in "
        "bf16, as the traced program does); mixed-precision Megatron keeps 16 bytes per "
        "parameter of optimizer state.",
        "* Allocator fragmentation, CUDA context and NCCL buffers: the budget is the whole 80 GB.",
        "* Kernel fusion's effect on kept activations (see above).",
    ]
    return "\n".join(out) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "tab:blue", "selective": "tab:orange", "full": "tab:green"}
    markers = {0: "o", 1: "s", 2: "^", 3: "D"}
    rows = r["sweep"]
    best = min(x["step_s"] for x in rows)
    fig, ax = plt.subplots(figsize=(9.5, 5))
    for remat in PL.REMATS:
        for zero in PL.ZERO_STAGES:
            pts = [x for x in rows if x["uniform_remat"] == remat and x["zero"] == zero]
            ax.scatter(
                [x["memory_gb"] for x in pts],
                [x["step_s"] for x in pts],
                s=10,
                alpha=0.45,
                c=colors[remat],
                marker=markers[zero],
                label=f"remat {remat}, ZeRO-{zero}",
            )
    for name, p, mk in (
        ("auto", r["auto"], "*"),
        ("Megatron full", r["megatron"]["full"], "P"),
        ("Megatron selective", r["megatron"]["selective"], "X"),
    ):
        ax.scatter(
            p["memory_gb"]["total"], p["step_s"], s=160, c="k", marker=mk, label=name, zorder=5
        )
    ax.axvline(r["memory_budget_gb"], color="r", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_ylim(best * 0.95, best * 2.5)
    ax.set_xlabel("per-device memory, GB (largest stage)")
    ax.set_ylabel("predicted step time, s")
    ax.set_title("GPT-3 175B, 1024 x A100 80 GB: memory vs step time (remat x ZeRO)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a100-80g")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--from-json", type=Path, help="only re-render from this JSON")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        r = json.loads(args.from_json.read_text())
    else:
        t0 = time.perf_counter()
        r = run(args.profile)
        r["seconds"] = time.perf_counter() - t0
        (args.out / "pipeline.json").write_text(json.dumps(r, indent=1) + "\n")
    plot(r, args.out / "pipeline_memory_time.png")
    md = markdown(r)
    (args.out / "pipeline.md").write_text(md)
    print(md)
    print(f"(run: {r['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
