"""Run the benchmark suite: ``python -m benchmarks.run [--quick] [--rows NAME,...]``.

For every row of ``benchmarks.suite``:

1. trace the train step once with ``jax.make_jaxpr`` (the trace time) and count its
   equations (the graph size);
2. search with each engine (``recursive``, ``dp``, ``data``, ``fsdp``, ``auto``; ``ilp``
   on the rows marked for it), recording the search seconds, the plan's predicted cost
   and, for ``auto``, its candidates;
3. compile every distinct plan on simulated CPU devices from abstract arguments and
   every hand-written baseline (``benchmarks.baselines``), read the compiled programs
   (``benchmarks.evaluator.measure``) and price them on the GPU profile;
4. complete each baseline's argument specs with autopar (``in_specs=``, the rest searched
   by the ``dp`` engine), price that plan and compile it: more of autopar's plans for the
   ranking check, each compared with its own compiled program.

GPT-3 175B is searched only, at 8 to 96 layers (``suite.GPT3_FULL``).
Results go to ``benchmarks/results/*.json``; ``benchmarks.report`` turns them into
``benchmarks/REPORT.md`` and the PNG plots.
"""

from __future__ import annotations

import os

_DEVICES = 16
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402
from autopar.meshes import make_mesh  # noqa: E402
from benchmarks import baselines as bl  # noqa: E402
from benchmarks import evaluator as ev  # noqa: E402
from benchmarks import suite  # noqa: E402
from benchmarks.analysis import summarize_row  # noqa: E402

PROFILE = "h100-sxm"
RESULTS = Path(__file__).resolve().parent / "results"
SEARCH_ENGINES = ("recursive", "dp", "data", "fsdp", "auto")
QUICK_COMPILE = ("recursive", "dp", "auto")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def count_eqns(jaxpr) -> int:
    """Equations of a closed jaxpr, nested jaxprs (jit, custom_vjp, ...) included."""
    from jax.extend import core as jcore

    def walk(j) -> int:
        n = 0
        for eqn in j.eqns:
            n += 1
            for v in eqn.params.values():
                for sub in v if isinstance(v, list | tuple) else [v]:
                    if isinstance(sub, jcore.ClosedJaxpr):
                        n += walk(sub.jaxpr)
                    elif isinstance(sub, jcore.Jaxpr):
                        n += walk(sub)
        return n

    return walk(jaxpr.jaxpr)


def config_json(cfg) -> dict:
    out = {}
    for k, v in cfg.__dict__.items():
        out[k] = str(np.dtype(v)) if k == "dtype" else (list(v) if isinstance(v, tuple) else v)
    return out


def plan_signature(plan) -> tuple:
    return (
        tuple(str(r.spec) for r in plan.inputs),
        tuple(o.strategy for o in plan.ops),
    )


def predicted_flops(par, args, plan) -> float:
    """Per-device FLOPs the cost model counts for ``plan`` (sum of op FLOPs / parallelism).
    Reads the searched problem from the Parallelized cache (an internal: if it moves,
    this fails loudly rather than leaving the column empty)."""
    problem = par._get(*par._bind(args, {})).problem
    n_in = problem.num_inputs
    total = 0.0
    for k, op in enumerate(plan.ops):
        v = n_in + k
        match = [s for s in problem.strategies[v] if s.name == op.strategy]
        par_deg = match[0].parallel if match else 1
        total += float(problem.flops[v]) / max(par_deg, 1)
    return total


def compile_and_price(lower_fn, mesh, dtype, profile: str | None = None) -> dict:
    t = time.perf_counter()
    lowered = lower_fn()
    lower_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="autopar-xla-dump-") as dump:
        compiled, compile_s = ev.compile_lowered(lowered, dump)
        m = ev.measure(compiled, mesh, compile_s, dump_dir=dump)
    p = ev.price(m, profile or PROFILE, mesh, dtype)
    return {"lower_s": lower_s, "measured": m.to_json(), "priced": p.to_json()}


def bench_row(row: suite.Row, quick: bool) -> dict:
    t_row = time.perf_counter()
    ts = row.module.make_train_step(row.config)
    args = row.module.abstract_args(row.config)
    t = time.perf_counter()
    jaxpr = jax.make_jaxpr(ts.step)(*args)
    trace_s = time.perf_counter() - t
    t = time.perf_counter()
    jax.make_jaxpr(ts.step)(*args)
    trace_warm_s = time.perf_counter() - t
    res: dict = {
        "row": row.name,
        "family": row.family,
        "params": row.params_label,
        "devices": row.devices,
        "mesh": row.mesh_shape,
        "layers": row.layers,
        "full_layers": row.full_layers,
        "config": config_json(row.config),
        "profile": PROFILE,
        "trace_s": trace_s,
        "trace_warm_s": trace_warm_s,
        "eqns": count_eqns(jaxpr),
        "engines": {},
        "programs": {},
        "baselines": {},
    }
    log(f"{row.name}: traced {res['eqns']} eqns in {trace_s:.2f}s")
    engines = list(SEARCH_ENGINES) + (["ilp"] if row.ilp and not quick else [])
    pars: dict[str, tuple] = {}
    for eng in engines:
        par = autopar.parallelize(
            ts.step, mesh=row.mesh_shape, cluster=PROFILE, engine=eng, donate_argnums=(0,)
        )
        t = time.perf_counter()
        try:
            plan = par.plan(*args)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            res["engines"][eng] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            log(f"{row.name}: {eng} failed: {res['engines'][eng]['error']}")
            continue
        wall = time.perf_counter() - t
        res["engines"][eng] = {
            "search_s": plan.search_seconds,
            "plan_wall_s": wall,
            "search_trace_ratio": plan.search_seconds / trace_s,
            "picked": plan.engine,
            "predicted": plan.cost.to_json(),
            "predicted_flops": predicted_flops(par, args, plan),
            "candidates": {k: v.to_json() for k, v in plan.candidates.items()},
            "warnings": list(plan.warnings),
        }
        pars[eng] = (par, plan)
        log(
            f"{row.name}: {eng} -> {plan.engine} in {plan.search_seconds:.2f}s "
            f"(wall {wall:.2f}s), predicted {plan.cost.step_s * 1e3:.2f} ms"
        )
    mesh = make_mesh(row.mesh_shape)
    # Compile each distinct plan once (--quick: only recursive, dp and auto's pick).
    by_sig: dict[tuple, str] = {}
    for eng, (par, plan) in pars.items():
        if quick and eng not in QUICK_COMPILE:
            continue
        sig = plan_signature(plan)
        if sig in by_sig:
            res["engines"][eng]["program"] = by_sig[sig]
            continue
        name = plan.engine if eng == "auto" else eng
        if name in res["programs"]:
            name = f"{name}({eng})"
        by_sig[sig] = name
        res["engines"][eng]["program"] = name
        try:
            out = compile_and_price(lambda par=par: par.lower(*args), mesh, row.dtype)
        except Exception as e:  # noqa: BLE001
            out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            log(traceback.format_exc())
        out["engine"] = eng
        out["predicted"] = res["engines"][eng]["predicted"]
        out["predicted_flops"] = res["engines"][eng]["predicted_flops"]
        res["programs"][name] = out
        if "priced" in out:
            log(
                f"{row.name}: program {name} compiled in {out['measured']['compile_s']:.1f}s, "
                f"priced {out['priced']['step_no_overlap_s'] * 1e3:.2f} ms"
            )
    mesh_shape = row.mesh_shape
    for b in bl.for_model(row.family):
        base = bl.BASELINES[b]
        entry: dict = {"description": base.description}
        try:
            j = bl.jitted(ts.step, base, args, mesh)
            entry.update(compile_and_price(lambda j=j: j.lower(*args), mesh, row.dtype))
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            log(traceback.format_exc())
        try:
            par = autopar.parallelize(
                ts.step,
                mesh=mesh_shape,
                cluster=PROFILE,
                engine="dp",
                donate_argnums=(0,),
                in_specs=bl.specs(base, args, mesh_shape),
                memory_budget=1e15,  # price it even if it would not fit
            )
            t = time.perf_counter()
            plan = par.plan(*args)
            entry["autopar_priced"] = plan.cost.to_json()
            entry["autopar_priced_s"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001
            entry["autopar_priced_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        else:
            # autopar's completion is a program of its own: compile it too, so that the
            # ranking check compares a prediction with the program it predicts (the
            # baseline itself is GSPMD's completion of the same argument specs).
            sig = plan_signature(plan)
            if sig in by_sig:
                entry["pinned_program"] = by_sig[sig]
            else:
                try:
                    pinned = compile_and_price(lambda par=par: par.lower(*args), mesh, row.dtype)
                except Exception as e:  # noqa: BLE001
                    pinned = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                    log(traceback.format_exc())
                pinned["predicted"] = plan.cost.to_json()
                pinned["predicted_flops"] = predicted_flops(par, args, plan)
                entry["pinned"] = pinned
                by_sig[sig] = f"pinned:{b}"
        res["baselines"][b] = entry
        if "priced" in entry:
            log(
                f"{row.name}: baseline {b} compiled in {entry['measured']['compile_s']:.1f}s, "
                f"priced {entry['priced']['step_no_overlap_s'] * 1e3:.2f} ms"
            )
    if not quick:
        res["f32_memory"] = f32_memory(row)
    summarize_row(res)
    res["row_wall_s"] = time.perf_counter() - t_row
    log(f"{row.name}: done in {res['row_wall_s']:.0f}s")
    return res


def f32_memory(row: suite.Row) -> dict:
    """The memory check once more with the model in float32.

    XLA:CPU computes bf16 dots and convolutions in f32 and keeps f32 copies of their
    bf16 operands; a GPU build does not, and the cost model prices a GPU. In float32
    there is nothing to upcast, so predicted against compiled memory there measures
    the predictor rather than the CPU backend. Auto's plan, searched for the f32 model.
    """
    cfg = dataclasses.replace(row.config, dtype=jnp.float32)
    ts = row.module.make_train_step(cfg)
    args = row.module.abstract_args(cfg)
    par = autopar.parallelize(
        ts.step, mesh=row.mesh_shape, cluster=PROFILE, engine="auto", donate_argnums=(0,)
    )
    try:
        plan = par.plan(*args)
        compiled, compile_s = ev.compile_lowered(par.lower(*args))
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        log(traceback.format_exc())
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    mem = ev.compiled_memory(compiled.memory_analysis())
    out = {
        "picked": plan.engine,
        "pred_memory": plan.cost.peak_memory_bytes,
        "pred_arg_bytes": plan.cost.argument_bytes,
        "compiled": mem,
        "compile_s": compile_s,
    }
    log(
        f"{row.name}: f32 {plan.engine} memory predicted {out['pred_memory'] / 2**30:.2f} GiB, "
        f"compiled {mem['total'] / 2**30:.2f} GiB"
    )
    return out


def bench_gpt3(plan: dict[int, tuple[str, ...]]) -> list[dict]:
    out = []
    for L, engines in plan.items():
        row = suite.gpt3(L)
        ts = row.module.make_train_step(row.config)
        args = row.module.abstract_args(row.config)
        t = time.perf_counter()
        jaxpr = jax.make_jaxpr(ts.step)(*args)
        trace_s = time.perf_counter() - t
        entry = {
            "row": row.name,
            "layers": L,
            "full_layers": 96,
            "devices": 64,
            "mesh": row.mesh_shape,
            "config": config_json(row.config),
            "trace_s": trace_s,
            "eqns": count_eqns(jaxpr),
            "engines": {},
        }
        for eng in engines:
            par = autopar.parallelize(
                ts.step, mesh=row.mesh_shape, cluster=PROFILE, engine=eng, donate_argnums=(0,)
            )
            t = time.perf_counter()
            try:
                plan = par.plan(*args)
                entry["engines"][eng] = {
                    "search_s": plan.search_seconds,
                    "plan_wall_s": time.perf_counter() - t,
                    "search_trace_ratio": plan.search_seconds / trace_s,
                    "picked": plan.engine,
                    "predicted": plan.cost.to_json(),
                }
                log(f"{row.name}: {eng} -> {plan.engine} in {plan.search_seconds:.1f}s")
            except Exception as e:  # noqa: BLE001
                entry["engines"][eng] = {
                    "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                    "plan_wall_s": time.perf_counter() - t,
                }
                log(f"{row.name}: {eng} failed: {entry['engines'][eng]['error']}")
        out.append(entry)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few rows, < 5 min on 2 cores")
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--no-gpt3", action="store_true", help="skip the GPT-3 175B search rows")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "quick" if ns.quick else "full"
    t0 = time.perf_counter()
    rows = suite.rows(ns.quick)
    if ns.rows:
        want = set(ns.rows.split(","))
        rows = [r for r in suite.ROWS if r.name in want]
    meta = {
        "mode": tag,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "devices": len(jax.devices()),
        "profile": PROFILE,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    results = []
    for row in rows:
        try:
            results.append(bench_row(row, ns.quick))
        except Exception as e:  # noqa: BLE001
            log(traceback.format_exc())
            results.append({"row": row.name, "error": f"{type(e).__name__}: {e}"})
        (out / f"{row.name}.{tag}.json").write_text(json.dumps(results[-1], indent=1, default=str))
    gpt3 = []
    if not ns.no_gpt3 and not ns.rows:
        gpt3 = bench_gpt3(suite.GPT3_QUICK if ns.quick else suite.GPT3_FULL)
        (out / f"gpt3_175b_search_{tag}.json").write_text(json.dumps(gpt3, indent=1, default=str))
    meta["wall_s"] = time.perf_counter() - t0
    meta["loadavg_end"] = os.getloadavg()
    summary = {"meta": meta, "rows": [r["row"] for r in results]}
    (out / f"run_{tag}.json").write_text(json.dumps(summary, indent=1, default=str))
    log(f"{tag} run done in {meta['wall_s']:.0f}s")
    try:
        from benchmarks import report

        report.write(out)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
