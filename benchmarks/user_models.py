"""Train steps written as public Flax code writes them, autopar's default plan against
hand layouts: ``python -m benchmarks.user_models [--quick] [--only NAME...] [--profile P]``.

The models (``benchmarks.user_models_defs``): a linen MLP, a BERT-style post-LN encoder
(fused qkv, dropout with an rng), GPT-2 (``h_i``, fused ``c_attn``), Llama (RoPE, GQA,
RMSNorm, SwiGLU), a ResNet with BatchNorm (``TrainState`` with ``batch_stats``), a
MobileNet (depthwise convolutions), a top-2 MoE (einsum dispatch/combine), an
embedding-heavy recommender, a T5-style encoder-decoder, a ViT, an NNX MLP (the README's
step) and a tiny MLP where replication should win. Each has two configurations, one with
many samples (``batch``) and one with wide layers (``wide``), on 4 or 8 simulated CPU
devices.

For every row:

1. ``autopar.parallelize(step, mesh=..., cluster=profile)`` with its defaults (engine
   ``auto``): the ``.plan()`` wall time, the engine it picked, its predicted step time
   and the layout of its arguments; then its program, compiled from abstract arguments
   and priced on the profile (``benchmarks.run.compile_and_price``:
   ``benchmarks.evaluator`` reads the compiled collectives, flops and bytes);
2. the hand layouts of ``benchmarks.baselines`` (``replicated``, ``dp``, ``fsdp``,
   ``megatron`` where the model has layers it names, ``expert``/``expert_all`` on the MoE)
   as plain ``jax.jit`` shardings of the state and batch arguments (GSPMD decides every
   other layout), compiled and priced the same way;
3. the ratio of auto's priced step time (no overlap: compute + communication) to the
   fastest baseline's.

Per model, a numerics check: the auto plan of a small configuration (on the mesh of the
``wide`` row, big enough that the plan splits something; the table says which arguments),
run on concrete arguments for 2 steps, against ``jax.jit`` of the same step (losses within
a relative 1e-4; the largest difference of the new state is recorded too: Adam turns
rounding noise on near-zero gradients into steps of the learning rate, so it is not
asserted).

Results: ``benchmarks/results/user_models.{json,md}`` (``--quick``: ``user_models_quick``).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import autopar  # noqa: E402
from autopar.meshes import make_mesh  # noqa: E402
from benchmarks import baselines as bl  # noqa: E402
from benchmarks.run import RESULTS, compile_and_price, log  # noqa: E402
from benchmarks.user_models_defs import MODELS, Case  # noqa: E402

BASELINE_ORDER = ("replicated", "dp", "fsdp", "megatron", "expert", "expert_all")
LOSS_RTOL = 1e-4


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def _ms(entry: dict | None, key: str = "step_no_overlap_s") -> float:
    if not entry or "priced" not in entry:
        return math.inf
    return entry["priced"].get(key, math.nan) * 1e3


def layout(plan) -> dict[str, str]:
    """Per top-level argument: its specs, weighted by bytes (``R`` replicated,
    ``S(axis)`` split), the two heaviest, e.g. ``params: RS(model) 62%, RR 38%``."""
    by_arg: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in plan.inputs:
        if not r.shape:
            continue
        nbytes = math.prod(r.shape) * max(np.dtype(r.dtype).itemsize, 1)
        by_arg[r.path.split("/")[0]][str(r.spec)] += nbytes
    out = {}
    for arg, specs in by_arg.items():
        total = sum(specs.values()) or 1
        top = sorted(specs.items(), key=lambda kv: -kv[1])[:2]
        out[arg] = ", ".join(f"{s} {100 * n / total:.0f}%" for s, n in top)
    return out


def baselines_for(name: str, case: Case, fargs, sa, mesh_shape) -> dict[str, str | None]:
    """Each baseline name -> None (run it) or why it is skipped."""
    out: dict[str, str | None] = {}
    for b in BASELINE_ORDER:
        if b.startswith("expert") and name != "moe":
            continue
        if b in ("megatron", "expert") and "model" not in mesh_shape:
            out[b] = "no model axis"
        elif b == "megatron" and not bl.splits_anything(bl.BASELINES[b], fargs, mesh_shape, sa):
            out[b] = "no layer it names"
        else:
            out[b] = None
    return out


def bench_row(name: str, cfg_name: str, profile: str) -> dict:
    t_row = time.perf_counter()
    builder, configs, _ = MODELS[name]
    cfg, mesh_shape = configs[cfg_name]
    case = builder(cfg)
    args = case.args(concrete=False)
    mesh = make_mesh(mesh_shape)
    res: dict = {
        "model": name,
        "config": cfg_name,
        "cfg": cfg,
        "mesh": mesh_shape,
        "profile": profile,
        "auto": {},
        "baselines": {},
    }
    par = autopar.parallelize(case.step, mesh=mesh_shape, cluster=profile, progress=False)
    t = time.perf_counter()
    try:
        plan = par.plan(*args)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        res["auto"]["error"] = _err(e)
        res["auto"]["plan_wall_s"] = time.perf_counter() - t
        log(f"{name}/{cfg_name}: auto plan failed: {res['auto']['error']}")
        log(traceback.format_exc())
    else:
        res["auto"].update(
            plan_wall_s=time.perf_counter() - t,
            engine=plan.engine,
            predicted=plan.cost.to_json(),
            candidates={k: v.to_json() for k, v in plan.candidates.items()},
            warnings=list(plan.warnings),
            layout=layout(plan),
            phases=plan.phases,
        )
        log(
            f"{name}/{cfg_name}: auto -> {plan.engine} in {res['auto']['plan_wall_s']:.2f}s, "
            f"predicted {plan.cost.step_s * 1e3:.4g} ms; {res['auto']['layout']}"
        )
        try:
            res["auto"].update(
                compile_and_price(lambda: par.lower(*args), mesh, jnp.float32, profile)
            )
            log(f"{name}/{cfg_name}: auto priced {_ms(res['auto']):.4g} ms")
        except Exception as e:  # noqa: BLE001
            res["auto"]["compile_error"] = _err(e)
            log(traceback.format_exc())
    fn, fargs, sa, ba = case.functional(args)
    for b, skip in baselines_for(name, case, fargs, sa, mesh_shape).items():
        if skip:
            res["baselines"][b] = {"skipped": skip}
            continue
        entry: dict = {"description": bl.BASELINES[b].description}
        try:
            j = bl.user_jitted(fn, bl.BASELINES[b], fargs, mesh, sa, ba)
            entry.update(compile_and_price(lambda j=j: j.lower(*fargs), mesh, jnp.float32, profile))
            log(f"{name}/{cfg_name}: {b} priced {_ms(entry):.4g} ms")
        except Exception as e:  # noqa: BLE001
            entry["error"] = _err(e)
            log(traceback.format_exc())
        res["baselines"][b] = entry
    priced = {b: _ms(e) for b, e in res["baselines"].items() if math.isfinite(_ms(e))}
    if priced:
        best = min(priced, key=priced.get)
        res["best_baseline"], res["best_baseline_ms"] = best, priced[best]
        if math.isfinite(_ms(res["auto"])):
            res["auto_ms"] = _ms(res["auto"])
            res["ratio"] = res["auto_ms"] / priced[best]
    # secondary: the same programs with compute priced kernel by kernel (`evaluator.kernels`)
    kernel = {b: _ms(e, "step_kernels_s") for b, e in res["baselines"].items()}
    kernel = {b: v for b, v in kernel.items() if math.isfinite(v)}
    if kernel and math.isfinite(_ms(res["auto"], "step_kernels_s")):
        best = min(kernel, key=kernel.get)
        res["kernel_best_baseline"], res["kernel_best_baseline_ms"] = best, kernel[best]
        res["kernel_ratio"] = _ms(res["auto"], "step_kernels_s") / kernel[best]
    res["row_wall_s"] = time.perf_counter() - t_row
    return res


def _run_steps(f, args: tuple, state_argnums, steps: int = 2):
    args, losses = list(args), []
    for _ in range(steps):
        out = f(*args)
        for k, i in enumerate(state_argnums):
            args[i] = out[k]
        losses.append(float(out[-1]))
    return losses, [args[i] for i in state_argnums]


def _max_diff(a, b) -> float:
    diffs = [
        float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.size
    ]
    return max(diffs, default=0.0)


def numerics(name: str, profile: str) -> dict:
    """Auto's plan of the small configuration against ``jax.jit``: 2 steps."""
    builder, _, (cfg, mesh_shape) = MODELS[name]
    case = builder(cfg)
    out: dict = {"cfg": cfg, "mesh": mesh_shape}
    t = time.perf_counter()
    try:
        fn, fargs, sa, _ = case.functional(case.args(concrete=True))
        ref_losses, ref_state = _run_steps(jax.jit(fn), fargs, sa)
        par = autopar.parallelize(case.step, mesh=mesh_shape, cluster=profile, progress=False)
        args = case.args(concrete=True)
        plan = par.plan(*args)
        out["engine"], out["layout"] = plan.engine, layout(plan)  # replicated: a weak check
        if case.nnx:
            losses = [float(par(*args)) for _ in range(2)]
            state = [nnx.split((args[0], args[1]))[1]]
        else:
            losses, state = _run_steps(par, args, case.state_argnums)
    except Exception as e:  # noqa: BLE001
        out["error"] = _err(e)
        log(f"{name}: numerics failed: {out['error']}")
        log(traceback.format_exc())
        return out
    rel = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, ref_losses))
    out.update(
        losses=losses,
        jit_losses=ref_losses,
        loss_rel_diff=rel,
        state_max_abs_diff=_max_diff(state, ref_state),
        ok=rel <= LOSS_RTOL,
        wall_s=time.perf_counter() - t,
    )
    log(f"{name}: numerics {'ok' if out['ok'] else 'MISMATCH'} (loss rel diff {rel:.2e})")
    return out


def _fmt(x: float, digits: int = 4) -> str:
    """``digits`` significant digits (step times span 1e-4 to 1e2 ms)."""
    return f"{x:.{digits}g}" if x is not None and math.isfinite(x) else "-"


def markdown(rows: list[dict], checks: dict, meta: dict) -> str:
    lines = [
        "# User-style Flax train steps: autopar's default plan against hand layouts",
        "",
        f"`python -m benchmarks.user_models{' --quick' if meta['mode'] == 'quick' else ''}"
        f" --profile {meta['profile']}`, {meta['started']}, jax {meta['jax']}, "
        f"{meta['devices']} simulated CPU devices, {meta['cpus']} CPUs, "
        f"wall {meta['wall_s']:.0f} s.",
        "",
        "Priced: the compiled program (XLA on simulated CPU devices) priced on the profile by "
        "`benchmarks.evaluator` (float32 dots at the rate JAX's default matmul precision runs "
        "them at, TF32 where the profile has it: `evaluator.dot_rate`), compute + "
        "communication (no overlap). Baselines are plain "
        "`jax.jit` shardings of the state and batch (`benchmarks.baselines`). Ratio = auto / "
        "best baseline (< 1: auto faster). Predicted: autopar's own cost model for its plan. "
        "Secondary, *per-kernel ratio*: the same programs with compute priced as the sum of "
        "each kernel's roofline (`evaluator.kernels`) instead of one roofline of the whole "
        "program's FLOPs and bytes, against the best baseline so priced.",
        "",
        "| model | config | mesh | auto engine | .plan() s | auto priced ms | "
        "best baseline (ms) | ratio | predicted ms | per-kernel ratio | baselines (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mesh = "x".join(f"{k}{v}" for k, v in r.get("mesh", {}).items())
        a = r.get("auto", {})
        if "error" in r:
            lines.append(f"| {r['model']} | {r['config']} | {mesh} | ERROR: {r['error']} |")
            continue
        engine = a.get("engine") or f"ERROR: {a.get('error', '')}"
        if "compile_error" in a:
            engine += f" (compile: {a['compile_error']})"
        pred = a.get("predicted", {}).get("step_s", math.nan) * 1e3
        others = ", ".join(
            f"{b} {_fmt(_ms(e))}" if "skipped" not in e and "error" not in e else f"{b} n/a"
            for b, e in r["baselines"].items()
            if "skipped" not in e
        )
        best = (
            f"{r['best_baseline']} {_fmt(r['best_baseline_ms'])}" if "best_baseline" in r else "-"
        )
        lines.append(
            f"| {r['model']} | {r['config']} | {mesh} | {engine} | "
            f"{_fmt(a.get('plan_wall_s', math.nan), 3)} | {_fmt(_ms(a))} | {best} | "
            f"{_fmt(r.get('ratio', math.nan))} | {_fmt(pred)} | "
            f"{_fmt(r.get('kernel_ratio', math.nan))} | {others} |"
        )
    lines += ["", "## Auto's layouts (bytes per spec, the two heaviest per argument)", ""]
    for r in rows:
        for arg, spec in r.get("auto", {}).get("layout", {}).items():
            lines.append(f"- {r['model']}/{r['config']} `{arg}`: {spec}")
    lines += ["", "## Numerics (auto plan vs jax.jit, 2 steps, small concrete inputs)", ""]
    lines += [
        "| model | mesh | engine | splits (arguments) | loss rel diff | state max abs diff | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in checks.items():
        mesh = "x".join(f"{k}{v}" for k, v in c.get("mesh", {}).items())
        if "error" in c:
            lines.append(f"| {name} | {mesh} | ERROR: {c['error']} | | | | no |")
            continue
        split = [a for a, spec in c.get("layout", {}).items() if "S[" in spec]
        split = ", ".join(split) or ("none: all replicated" if "layout" in c else "?")
        lines.append(
            f"| {name} | {mesh} | {c['engine']} | {split} | {c['loss_rel_diff']:.1e} | "
            f"{c['state_max_abs_diff']:.1e} | {'yes' if c['ok'] else 'NO'} |"
        )
    errors = [(r["model"], r["config"], k, v) for r in rows for k, v in _errors(r)]
    errors += [(n, "numerics", "", c["error"]) for n, c in checks.items() if "error" in c]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"- {m}/{c} {k}: `{v}`" for m, c, k, v in errors]
    return "\n".join(lines) + "\n"


def _errors(r: dict):
    if "error" in r:
        yield "row", r["error"]
    for k in ("error", "compile_error"):
        if k in r.get("auto", {}):
            yield f"auto {k}", r["auto"][k]
    for b, e in r.get("baselines", {}).items():
        if "error" in e:
            yield b, e["error"]


def _git() -> dict:
    """The commit, and autopar's files with uncommitted changes (they are what ran)."""
    root = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(
        ["git", *a], cwd=root, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "head": git("rev-parse", "HEAD"),
        "dirty": git("status", "--short", "autopar").split("\n"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first configuration of each model")
    ap.add_argument("--only", nargs="+", default=[], metavar="NAME", help="models to run")
    ap.add_argument("--profile", default="h100-sxm", help="cost_models profile (a100-80g, ...)")
    ap.add_argument("--no-numerics", action="store_true", help="skip the numerics checks")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ns = ap.parse_args(argv)
    names = ns.only or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    tag = "quick" if ns.quick else "full"
    meta = {
        "mode": tag,
        "profile": ns.profile,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "devices": len(jax.devices()),
        "loadavg_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "git": _git(),
    }
    t0 = time.perf_counter()
    rows, checks = [], {}
    for name in names:
        cfgs = list(MODELS[name][1])
        for cfg_name in cfgs[:1] if ns.quick else cfgs:
            try:
                rows.append(bench_row(name, cfg_name, ns.profile))
            except Exception as e:  # noqa: BLE001
                log(traceback.format_exc())
                rows.append({"model": name, "config": cfg_name, "error": _err(e)})
            log(f"{name}/{cfg_name}: ratio {_fmt(rows[-1].get('ratio', math.nan))}")
        if not ns.no_numerics:
            checks[name] = numerics(name, ns.profile)
    meta["wall_s"] = time.perf_counter() - t0
    meta["loadavg_end"] = os.getloadavg()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "user_models" if tag == "full" else "user_models_quick"
    payload = {"meta": meta, "rows": rows, "numerics": checks}
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / f"{stem}.md").write_text(markdown(rows, checks, meta))
    log(f"{tag} run done in {meta['wall_s']:.0f}s -> {out / stem}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
