"""Search time at GPT-3 175B scale: ``python -m benchmarks.scale [--quick]``.

The GPT-3 175B train step (96 layers, hidden 12288, 96 heads, seq 2048, batch
1536, bf16, AdamW; unrolled) from abstract arguments, on an abstract mesh
``{"data": 128, "model": 8}`` (1024 devices), h100-sxm cost profile. One run
measures, per configuration:

* ``trace_s``: ``jax.make_jaxpr`` of the step (the yardstick);
  for the headline (96 layers) the trace, the build and each search run twice
  and the faster run counts, as the machine is shared;
* ``capture_s``: autopar's capture (the same trace, into its graph);
* ``build_s``: pricing every op's strategies (``build_problem``);
* per engine (``recursive``, ``dp``): ``search_s``, the search driver's time
  as ``Plan.search_seconds`` reports it (engine + pricing of the plan; no
  memory budget, so no ZeRO-3 retry), its ratio to ``trace_s``, the plan's
  predicted step and memory, and the fraction of parameter bytes the plan
  shards (any spec but fully replicated);
* ``+zero3``: the same engine with parameters and optimizer state pinned
  sharded over the data axes, which is what the driver retries when a plan is
  over the memory budget;
* ``dp_full``: ``dp`` without the repeated-layer reduction (at small depths
  only: it grows linearly), for the plan-quality comparison.

Then the search time against depth (8 .. 96 layers at 1024 devices) and
against device count (64 .. 1024 devices as ``{"data": d, "model": 8}``).
Writes ``benchmarks/results/scale.json``, ``scale_layers.png``,
``scale_devices.png`` and ``scale.md``. Timings are wall-clock on a shared
machine: compare the ratios, measured side by side in one process.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

import cost_models  # noqa: E402
from autopar.cost.model import CostModel  # noqa: E402
from autopar.examples.models import gpt  # noqa: E402
from autopar.ir.capture import capture  # noqa: E402
from autopar.meshes import make_mesh  # noqa: E402
from autopar.search import ENGINES, dp_starts, layouts, search  # noqa: E402
from autopar.search import layers as layer_reduction  # noqa: E402
from autopar.search.evaluate import evaluate  # noqa: E402
from autopar.search.problem import build_problem  # noqa: E402
from autopar.sharding import mesh_info  # noqa: E402
from benchmarks import suite  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROFILE = "h100-sxm"
MESH = {"data": 128, "model": 8}


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gpt3_config(layers: int, batch: int = 1536) -> gpt.GPTConfig:
    return dataclasses.replace(suite.gpt3(layers).config, batch_size=batch)


def count_eqns(jaxpr) -> int:
    return len(jaxpr.jaxpr.eqns)


def param_fraction(problem, choice) -> tuple[float, float]:
    """(fraction of parameter bytes sharded, fraction of all state bytes sharded):
    parameters are the arguments under ``/params/``; state is every argument that the
    step returns updated (params and optimizer state)."""
    g = problem.graph
    state = set(problem.aliases.values())
    tot = [0, 0]
    sharded = [0, 0]
    for i, path in enumerate(g.input_paths):
        b = g.values[g.inputs[i]].nbytes
        on = bool(problem.strategies[i][choice[i]].out_specs[0].used_axes)
        for k, member in enumerate(("/params/" in f"/{path}", i in state)):
            if member:
                tot[k] += b
                sharded[k] += b * on
    return sharded[0] / max(tot[0], 1), sharded[1] / max(tot[1], 1)


def _plan_json(problem, choice, seconds: float, trace_s: float) -> dict:
    cost = evaluate(problem, choice)
    params, state = param_fraction(problem, choice)
    return {
        "search_s": seconds,
        "search_trace_ratio": seconds / trace_s,
        "objective_s": problem.cost_graph().total(choice),
        "step_s": cost.step_s,
        "compute_s": cost.compute_s,
        "comm_s": cost.comm_s,
        "peak_memory_gib": cost.peak_memory_bytes / 2**30,
        "argument_gib": cost.argument_bytes / 2**30,
        "param_bytes_sharded": params,
        "state_bytes_sharded": state,
    }


def measure(
    layers: int,
    mesh_shape: dict[str, int],
    batch: int = 1536,
    engine_names: tuple[str, ...] = ("recursive", "dp"),
    zero3: bool = False,
    dp_full: bool = False,
    repeat: int = 1,
) -> dict:
    """One configuration; with ``repeat`` > 1 the trace, build and each search are
    timed that many times and the fastest counts (the machine is shared)."""
    cfg = gpt3_config(layers, batch)
    ts = gpt.make_train_step(cfg)
    args = gpt.abstract_args(cfg)
    trace_runs = []
    for _ in range(repeat):
        fresh = gpt.make_train_step(cfg)  # make_jaxpr caches by function: a new one
        gc.collect()
        t = time.perf_counter()
        jaxpr = jax.make_jaxpr(fresh.step)(*args)
        trace_runs.append(time.perf_counter() - t)
        eqns = count_eqns(jaxpr)
        del jaxpr
    trace_s = min(trace_runs)
    profile = cost_models.load(PROFILE)
    mesh = make_mesh(mesh_shape)
    info = mesh_info(mesh, profile.devices_per_node)
    t = time.perf_counter()
    graph = capture(ts.step, args)
    capture_s = time.perf_counter() - t
    build_runs = []
    for _ in range(repeat):
        problem = None
        gc.collect()
        t = time.perf_counter()
        problem = build_problem(graph, info, CostModel(profile, info))
        build_runs.append(time.perf_counter() - t)
    build_s = min(build_runs)
    devices = math.prod(mesh_shape.values())
    entry = {
        "layers": layers,
        "mesh": mesh_shape,
        "devices": devices,
        "batch": batch,
        "eqns": eqns,
        "ops": len(graph.nodes),
        "cost_graph_nodes": len(problem.strategies),
        "repeat": repeat,
        "trace_s": trace_s,
        "trace_s_runs": trace_runs,
        "capture_s": capture_s,
        "build_s": build_s,
        "build_s_runs": build_runs,
        "build_trace_ratio": build_s / trace_s,
        "engines": {},
    }
    log(
        f"L={layers} devices={devices}: {eqns} eqns, trace {trace_s:.2f}s, "
        f"capture {capture_s:.2f}s, build {build_s:.2f}s"
    )
    for name in engine_names:
        runs = [search(problem, name, math.inf) for _ in range(repeat)]
        res = min(runs, key=lambda r: r.seconds)
        e = _plan_json(problem, res.choice, res.seconds, trace_s)
        e["search_s_runs"] = [r.seconds for r in runs]
        e["total_trace_ratio"] = (build_s + res.seconds) / trace_s
        e["solver_info"] = {
            k: v for k, v in res.solver_info.get(name, {}).items() if k in ("optimal", "gap")
        }
        entry["engines"][name] = e
        log(
            f"  {name}: {res.seconds:.2f}s ({res.seconds / trace_s:.2f}x trace), "
            f"step {e['step_s']:.3f}s, params sharded {100 * e['param_bytes_sharded']:.1f}%"
        )
        if zero3 and name == "dp":
            # The reduced dp's solves (free; state bytes priced) and its best start
            # (autopar/search/layers.py, "Starts"), objective seconds.
            g = problem.cost_graph()
            sol = layer_reduction.solve_dp_layered(problem, g, starts=dp_starts(problem, g, {}))
            e["starts"] = sol.info.get("layers", {}).get("starts")
            e["layers"] = sol.info.get("layers", {}).get("groups")
            e["reduced_nodes"] = sol.info.get("layers", {}).get("reduced_nodes")
        if zero3:
            pins = {
                i: s for i, s in layouts.fsdp_pins(problem).items() if i in problem.aliases.values()
            }
            t = time.perf_counter()
            choice = ENGINES[name](problem, pins, {})
            seconds = time.perf_counter() - t
            e = _plan_json(problem, choice, seconds, trace_s)
            entry["engines"][f"{name}+zero3"] = e
            log(
                f"  {name}+zero3: {seconds:.2f}s, step {e['step_s']:.3f}s, "
                f"params sharded {100 * e['param_bytes_sharded']:.1f}%, "
                f"peak {e['peak_memory_gib']:.0f} GiB"
            )
    if dp_full:
        layer_reduction.ENABLED = False
        try:
            res = search(problem, "dp", math.inf)
        finally:
            layer_reduction.ENABLED = True
        seconds = res.seconds
        e = _plan_json(problem, res.choice, seconds, trace_s)
        e["total_trace_ratio"] = (build_s + seconds) / trace_s
        entry["engines"]["dp_full"] = e
        log(f"  dp_full (no layer reduction): {seconds:.2f}s, objective {e['objective_s']:.4f}s")
    return entry


def plot(rows: list[dict], x: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r[x])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [r[x] for r in rows]
    ax.plot(xs, [r["trace_s"] for r in rows], "k--o", label="jax.make_jaxpr (trace)")
    ax.plot(xs, [r["build_s"] for r in rows], ":s", color="grey", label="problem build")
    styles = {"recursive": "-o", "dp": "-^", "dp_full": "-.v"}
    labels = {"dp": "dp (layers solved once)", "dp_full": "dp without layer reduction"}
    for name, style in styles.items():
        pts = [(r[x], r["engines"][name]["search_s"]) for r in rows if name in r["engines"]]
        if pts:
            ax.plot(*zip(*pts), style, label=labels.get(name, name))
    ax.set_xlabel("layers" if x == "layers" else 'devices (mesh {"data": d, "model": 8})')
    ax.set_ylabel("seconds (wall clock, 2 shared cores)")
    if x == "devices":
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(v) for v in xs])
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _row(r: dict) -> str:
    cells = [
        str(r["layers"]),
        str(r["devices"]),
        str(r["eqns"]),
        f"{r['trace_s']:.2f}",
        f"{r['build_s']:.2f}",
    ]
    for name in ("recursive", "dp", "dp_full"):
        e = r["engines"].get(name)
        cells.append(
            f"{e['search_s']:.2f} ({e['search_trace_ratio']:.2f}x)" if e else "-",
        )
    return "| " + " | ".join(cells) + " |"


def _starts_note(head: dict) -> list[str]:
    dp = head["engines"].get("dp", {})
    starts = dp.get("starts")
    if not starts:
        return []
    groups = dp.get("layers") or {}
    merged = ", ".join(
        f"`{k}`: {v['merged']} of {v['layers']} layers merged into layer {v['representative']}"
        for k, v in groups.items()
    )
    text = ", ".join(f"{k} {v:.4f} s" for k, v in starts.items())
    return [
        f"dp solved a quotient graph of {dp.get('reduced_nodes')} nodes ({merged}). "
        f"Objective of its solves (free; state bytes priced, `layers.STATE_WEIGHT`) and of the "
        f"best of its starts (recursive's plan, and recursive's from Megatron's layout on each "
        f"axis, each polished by forest descent): "
        f"{text}; the cheaper one is the plan.",
        "",
    ]


def markdown(out: dict, suffix: str = "") -> str:
    head = out["headline"]
    lines = [
        "# GPT-3 175B search scaling",
        "",
        f"Generated by `python -m benchmarks.scale{' --quick' if out['meta']['quick'] else ''}` "
        f"on {out['meta']['cpus']} CPUs (load {out['meta']['loadavg_start'][0]:.1f} at start), "
        f"jax {out['meta']['jax']}, profile {PROFILE}. Wall-clock seconds on a shared "
        "machine: compare ratios, which are measured side by side in one process. "
        "Headline: the faster of two runs of each of trace, build and search; "
        "sweeps: one run each.",
        "",
        f"## Headline: {head['layers']} layers, mesh {head['mesh']} ({head['devices']} devices), "
        f"batch {head['batch']}",
        "",
        f"- `jax.make_jaxpr` trace: **{head['trace_s']:.2f} s** (runs: "
        f"{', '.join(f'{x:.2f}' for x in head.get('trace_s_runs', []))}; {head['eqns']} eqns; "
        f"{head['cost_graph_nodes']} cost-graph nodes); autopar capture {head['capture_s']:.2f} s; "
        f"problem build {head['build_s']:.2f} s ({head['build_trace_ratio']:.2f}x trace).",
        "",
        "| engine | search s | search / trace | (build + search) / trace | target | "
        "predicted step s | peak GiB | args GiB | param bytes sharded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    targets = {"recursive": 3.0, "dp": 10.0}
    for name, e in head["engines"].items():
        base = name.split("+")[0]
        tgt = targets.get(base)
        met = ""
        if tgt is not None and "+" not in name:
            met = f"<= {tgt:g}x: {'met' if e['search_trace_ratio'] <= tgt else 'MISSED'}"
        total = f"{e['total_trace_ratio']:.2f}" if "total_trace_ratio" in e else "-"
        lines.append(
            f"| {name} | {e['search_s']:.2f} | {e['search_trace_ratio']:.2f} | {total} | {met} | "
            f"{e['step_s']:.3f} | {e['peak_memory_gib']:.0f} | {e['argument_gib']:.1f} | "
            f"{100 * e['param_bytes_sharded']:.1f}% |"
        )
    lines += [
        "",
        "`+zero3`: the engine with parameters and optimizer state pinned sharded over the "
        "data axes, the plan the search driver retries when the first plan is over the "
        "memory budget. Without a budget the search minimizes predicted time only. "
        f"Peak memory is far over any GPU's: the step keeps every activation of "
        f"{head['layers']} layers (no rematerialization, no pipeline).",
        "",
        *_starts_note(head),
        "",
        "## Search time against depth",
        "",
        f"![](scale_layers{suffix}.png)",
        "",
        "| layers | devices | eqns | trace s | build s | recursive s (x trace) | dp s (x trace) "
        "| dp without reduction s (x trace) |",
        "|---|---|---|---|---|---|---|---|",
        *(_row(r) for r in sorted(out["layers"], key=lambda r: r["layers"])),
        "",
        "## Search time against device count",
        "",
        f"![](scale_devices{suffix}.png)",
        "",
        "| layers | devices | eqns | trace s | build s | recursive s (x trace) | dp s (x trace) "
        "| dp without reduction s (x trace) |",
        "|---|---|---|---|---|---|---|---|",
        *(_row(r) for r in sorted(out["devices"], key=lambda r: r["devices"])),
        "",
        "## Plan quality: dp with and without the layer reduction",
        "",
        "Objective = the search's own total (node + resharding seconds); predicted step = "
        "`evaluate` (resharding of a value shared by its uses).",
        "",
        "| layers | devices | dp objective s | dp without reduction objective s | change | "
        "dp step s | without reduction step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(out["layers"] + out["devices"], key=lambda r: (r["layers"], r["devices"])):
        if "dp_full" in r["engines"] and "dp" in r["engines"]:
            a, b = r["engines"]["dp"], r["engines"]["dp_full"]
            lines.append(
                f"| {r['layers']} | {r['devices']} | {a['objective_s']:.4f} | "
                f"{b['objective_s']:.4f} | {100 * (a['objective_s'] / b['objective_s'] - 1):+.1f}% | "
                f"{a['step_s']:.4f} | {b['step_s']:.4f} |"
            )
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="8 layers at most, 64 to 256 devices (~2 min)"
    )
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ns = ap.parse_args(argv)
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    meta = {
        "quick": ns.quick,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "profile": PROFILE,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if ns.quick:
        head_layers, depths, dp_full_upto = 8, [2, 4], 8
        dev_layers, datas = 4, [8, 16, 32]
    else:
        head_layers, depths, dp_full_upto = 96, [8, 16, 24, 48], 24
        dev_layers, datas = 24, [8, 16, 32, 64, 128]
    measure(2, {"data": 8, "model": 8})  # warm-up (imports, caches); not recorded
    layer_rows = [measure(L, MESH, dp_full=dp_full_upto >= L) for L in depths]
    head = measure(head_layers, MESH, zero3=True, dp_full=head_layers <= dp_full_upto, repeat=2)
    layer_rows.append(head)
    dev_rows = [
        measure(dev_layers, {"data": d, "model": 8}, dp_full=d <= 16 and not ns.quick)
        for d in datas
    ]
    meta["wall_s"] = time.perf_counter() - t0
    meta["loadavg_end"] = os.getloadavg()
    out = {"meta": meta, "headline": head, "layers": layer_rows, "devices": dev_rows}
    suffix = "_quick" if ns.quick else ""
    (out_dir / f"scale{suffix}.json").write_text(json.dumps(out, indent=1, default=str))
    plot(
        layer_rows,
        "layers",
        out_dir / f"scale_layers{suffix}.png",
        "GPT-3 175B shapes, 1024 devices: search time vs depth",
    )
    plot(
        dev_rows,
        "devices",
        out_dir / f"scale_devices{suffix}.png",
        f"GPT-3 175B shapes, {dev_layers} layers: search time vs devices",
    )
    (out_dir / f"scale{suffix}.md").write_text(markdown(out, suffix))
    log(f"done in {meta['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
