"""Turn ``benchmarks/results/*.json`` into ``benchmarks/REPORT.md`` and PNG plots.

``python -m benchmarks.report`` regenerates both from stored results (no JAX needed).
The full run's files are used when present, else the quick run's.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from benchmarks.analysis import summarize_row

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MiB = 2**20
GiB = 2**30

TARGET_RATIO = {"moe": 0.9, "wrn": 0.9}


def _load(out: Path):
    runs = {}
    for tag in ("full", "quick"):
        f = out / f"run_{tag}.json"
        if f.exists():
            runs[tag] = json.loads(f.read_text())
    tag = "full" if "full" in runs else "quick"
    rows = []
    if tag in runs:
        for name in runs[tag]["rows"]:
            f = out / f"{name}.{tag}.json"
            if f.exists():
                r = json.loads(f.read_text())
                if "engines" in r:
                    summarize_row(r)  # re-derive from the raw measurements
                rows.append(r)
    gpt3 = []
    f = out / f"gpt3_175b_search_{tag}.json"
    if f.exists():
        gpt3 = json.loads(f.read_text())
    return tag, runs, rows, gpt3


def _ms(s):
    return "—" if s is None or (isinstance(s, float) and not math.isfinite(s)) else f"{s * 1e3:.2f}"


def _pct(x):
    return "—" if x is None else f"{x * 100:+.1f}%"


def _f(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def _comm(d: dict) -> str:
    """Bytes per axis group (all kinds), MiB."""
    by: dict[str, float] = {}
    for k, v in d.items():
        axes = k.partition("@")[2] or "?"
        by[axes] = by.get(axes, 0.0) + v
    return ", ".join(f"{a}: {v / MiB:.0f}" for a, v in sorted(by.items()) if v >= 0.5 * MiB) or "0"


def _status(ok: bool | None) -> str:
    return "—" if ok is None else ("met" if ok else "**not met**")


def _base_label(s: dict) -> str:
    """The stronger baseline of a row and the lowering that made it so."""
    b = s.get("best_baseline")
    if b is None:
        return "—"
    return f"{b} ({'autopar' if s.get('best_baseline_lowering') == 'autopar' else 'GSPMD'})"


def quality_tables(rows) -> list[str]:
    L = []
    L.append(
        "Every baseline's argument specs are lowered two ways: by `jax.jit`, GSPMD "
        "choosing every other layout (the baseline as written), and by autopar, the specs "
        "given as `in_specs=` and the rest searched by `dp` (`pinned:<baseline>`). The "
        "*stronger baseline* of a row is the fastest baseline at the faster of its two "
        "lowerings (table 1c). The headline is `auto`, the plan `parallelize` returns by "
        "default, over the stronger baseline. *Best engine after compiling* is the fastest "
        "engine plan once every engine's plan is compiled (the ILP included, which `auto` "
        "never runs): a user gets it only by compiling them all. *Auto / best GSPMD "
        "baseline* divides by the fastest baseline as `jax.jit` lowers it: the gap between "
        "it and the headline is what GSPMD's layout choices cost, not plan quality.\n"
    )
    L.append("### 1a. Summary per row\n")
    L.append(
        "| model | devices | mesh | layers (of) | auto picked | auto step ms | "
        "stronger baseline (lowering) | its step ms | **auto / stronger baseline** | "
        "auto / best GSPMD baseline | best engine after compiling / stronger baseline | "
        "compute floor / stronger baseline | floor with least comm | target (auto) |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "summary" not in r:
            L.append(f"| {r['row']} | error: {r.get('error', '?')} |")
            continue
        s = r["summary"]
        tgt = TARGET_RATIO.get(r["family"], 1.0)
        ratio = s.get("auto_ratio")
        ok = None if ratio is None else ratio <= tgt
        mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items())
        L.append(
            f"| {r['row']} | {r['devices']} | {mesh} | {r['layers']} ({r['full_layers']}) | "
            f"{s.get('auto_program', '—')} | {_ms(s.get('auto_s'))} | {_base_label(s)} | "
            f"{_ms(s['best_baseline_s'])} | **{_f(ratio, 3)}** | "
            f"{_f(s.get('auto_ratio_gspmd'), 3)} ({s.get('best_gspmd_baseline') or '—'}) | "
            f"{_f(s.get('best_engine_ratio'), 3)} ({s.get('best_engine_program', '—')}) | "
            f"{_f(s.get('compute_floor_ratio'), 3)} | {_f(s.get('floor_ratio'), 3)} | "
            f"≤ {tgt}: {_status(ok)} |"
        )
    L.append("")
    L.append(
        "*Compute floor*: the lowest compiled compute term of any program measured in the "
        "row (plans, baselines and autopar's lowerings of the baselines' specs), with no "
        "communication at all, over the stronger baseline's step. A plan can score below "
        "it only by computing less per device than every program measured. Where it is "
        "above the target, no plan that merely communicates less reaches the target. "
        "*Floor with least comm* adds the least communication time of any program "
        "measured: a plan scores below it only by computing less, or communicating less, "
        "than every program measured.\n"
    )
    L.append("### 1b. Every plan and baseline\n")
    L.append(
        "Step times are on the `h100-sxm` profile. *predicted*: autopar's cost model "
        "(for a baseline: its argument specs pinned, the rest completed by `dp`; "
        "`pinned:<baseline>` is that completion compiled as autopar lowers it, or the "
        "engine plan it equals). *compiled*: the compiled program priced by `benchmarks.evaluator` (no overlap / "
        "perfect overlap). Comm is the compiled collective MiB per mesh-axis group. "
        "Memory is per device, GiB, predicted / compiled (`memory_analysis`).\n"
    )
    L.append(
        "| model | plan | engine s | engine s / trace | predicted step ms | compiled step ms | "
        "comm MiB by axes (compiled) | memory GiB | ratio to stronger baseline |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "summary" not in r:
            continue
        for name, p in r["programs"].items():
            eng = r["engines"].get(p.get("engine"), {})
            users = [e for e, v in r["engines"].items() if v.get("program") == name]
            label = name + (
                f" [{', '.join(u for u in users if u != name)}]"
                if len(users) > 1 or (users and users[0] != name)
                else ""
            )
            search = f"{_f(eng.get('search_s'))} | {_f(eng.get('search_trace_ratio'), 1)}"
            L.append(_plan_line(r, label, p, p.get("predicted", {}), search))
        for b, e in r["baselines"].items():
            L.append(_plan_line(r, f"baseline {b}", e, e.get("autopar_priced", {})))
            if "pinned" in e:
                L.append(_plan_line(r, f"pinned:{b}", e["pinned"], e["pinned"]["predicted"]))
            elif "pinned_program" in e:
                L.append(f"| {r['row']} | pinned:{b} | = {e['pinned_program']} |")
    L.append("")
    L += lowering_table(rows)
    return L


def lowering_table(rows) -> list[str]:
    """Table 1c: each baseline's specs lowered by GSPMD and by autopar."""
    L = [
        "### 1c. Each baseline, lowered two ways\n",
        "Compiled step ms (no overlap) of each baseline's argument specs as `jax.jit` "
        "lowers them (GSPMD completes the layouts) and as autopar lowers them (`in_specs=`, "
        "the rest searched by `dp`; the program is `pinned:<baseline>` or the engine plan "
        "it equals). The faster of the two is the baseline's figure in 1a.\n",
        "| model | baseline | GSPMD ms | autopar ms (program) | GSPMD / autopar | stronger |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "summary" not in r:
            continue
        for b, d in r["summary"]["baseline_lowerings"].items():
            g, a = d["gspmd_s"], d["autopar_s"]
            both = math.isfinite(g) and math.isfinite(a)
            best = " **(row's stronger baseline)**" if b == r["summary"]["best_baseline"] else ""
            L.append(
                f"| {r['row']} | {b} | {_ms(g)} | {_ms(a)} ({d['program'] or '—'}) | "
                f"{_f(g / a, 2) + 'x' if both else '—'} | "
                f"{'autopar' if d['stronger'] == 'autopar' else 'GSPMD'}{best} |"
            )
    L.append("")
    return L


def _plan_line(r: dict, label: str, e: dict, predicted: dict, search: str = "— | —") -> str:
    """One line of table 1b: a compiled program ``e`` of row ``r`` and its prediction."""
    if "priced" not in e:
        return f"| {r['row']} | {label} | error: {e.get('error', '?')} |"
    pr, m = e["priced"], e["measured"]
    return (
        f"| {r['row']} | {label} | {search} | {_ms(predicted.get('step_s'))} | "
        f"{_ms(pr['step_no_overlap_s'])} / {_ms(pr['step_overlap_s'])} | "
        f"{_comm(m['comm_bytes'])} | "
        f"{predicted.get('peak_memory_bytes', 0) / GiB:.2f} / "
        f"{m['memory']['total'] / GiB:.2f} | "
        f"{pr['step_no_overlap_s'] / r['summary']['best_baseline_s']:.3f} |"
    )


def search_tables(rows, gpt3) -> list[str]:
    L = ["### 2a. Suite rows\n"]
    engines = ["recursive", "dp", "data", "fsdp", "auto", "ilp"]
    L.append(
        "| model | devices | jaxpr eqns | trace s | "
        + " | ".join(f"{e}: engine s / `.plan()` s (engine x trace)" for e in engines)
        + " |"
    )
    L.append("|---|---|---|---|" + "---|" * len(engines))
    for r in rows:
        if "engines" not in r:
            continue
        cells = []
        for e in engines:
            v = r["engines"].get(e)
            if v is None:
                cells.append("—")
            elif "error" in v:
                cells.append("error")
            else:
                wall = _f(v.get("plan_wall_s"))
                cells.append(f"{v['search_s']:.2f} / {wall} ({v['search_trace_ratio']:.0f}x)")
        L.append(
            f"| {r['row']} | {r['devices']} | {r['eqns']} | {r['trace_s']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    L.append("")
    gaps = sorted(
        (v["plan_wall_s"] - v["search_s"], r["row"], e)
        for r in rows
        for e, v in r.get("engines", {}).items()
        if "plan_wall_s" in v and "search_s" in v
    )
    L.append(
        "*Engine s*: `Plan.search_seconds`, the engine (for `auto`, every engine it runs) "
        "with the polish and the pricing of its plan, and nothing else: no capture, no "
        "problem build. *`.plan()` s*: wall time of the `.plan()` call, what a user waits "
        "for: capture (tracing the step), problem build (pricing every op's strategies), "
        "the engine, the polish, and assembling the plan and its `jax.jit` (each engine is "
        "a fresh `parallelize`, timed in the benchmark process after the row's two "
        "traces). *Engine x trace*: engine seconds over the trace time."
        + (
            f" The difference, `.plan()` s - engine s, has median "
            f"{gaps[len(gaps) // 2][0]:.2f} s over the {len(gaps)} searches, "
            f"{gaps[0][0]:.2f} s at least, {gaps[-1][0]:.2f} s at most "
            f"({gaps[-1][1]} {gaps[-1][2]}).\n"
            if gaps
            else "\n"
        )
    )
    if gpt3:
        L.append("### 2b. GPT-3 175B (search only, 64 devices, data 8 x model 8, batch 8)\n")
        engs = sorted({e for g in gpt3 for e in g["engines"]}, key=engines.index)
        L.append(
            "| layers (of 96) | jaxpr eqns | trace s | "
            + " | ".join(f"{e}: engine s (`.plan()` wall s)" for e in engs)
            + " | predicted step ms (memory GiB) |"
        )
        L.append("|---|---|---|" + "---|" * len(engs) + "---|")
        for g in gpt3:
            cells = []
            pred = "—"
            for e in engs:
                v = g["engines"].get(e, {})
                if "error" in v:
                    cells.append(f"error after {v.get('plan_wall_s', 0):.0f}s: {v['error'][:60]}")
                elif v:
                    cells.append(f"{v['search_s']:.1f} ({v['plan_wall_s']:.1f})")
                    c = v["predicted"]
                    pred = f"{c['step_s'] * 1e3:.0f} ({c['peak_memory_bytes'] / GiB:.1f}, {v['picked']})"
                else:
                    cells.append("—")
            L.append(
                f"| {g['layers']} | {g['eqns']} | {g['trace_s']:.2f} | "
                + " | ".join(cells)
                + f" | {pred} |"
            )
        L.append("")
    return L


def f32_memory_table(rows) -> list[str]:
    have = [r for r in rows if "compiled" in r.get("f32_memory", {})]
    if not have:
        return []
    L = [
        "### Memory with the model in float32\n",
        "XLA:CPU computes bf16 dots and convolutions in f32 and keeps f32 copies of their "
        "operands, which a GPU build does not (see the discussion). Each row is searched "
        "again (`auto`) with every dtype float32, where there is nothing to upcast, and "
        "its compiled memory compared with the prediction. Same measure as above: "
        "arguments + outputs + temporaries - aliased, per device.\n",
        "| model | plan | memory GiB pred / compiled | memory err | arguments GiB pred / "
        "compiled | temporaries GiB (compiled) |",
        "|---|---|---|---|---|---|",
    ]
    for r in have:
        f, c = r["f32_memory"], r["f32_memory"]["compiled"]
        L.append(
            f"| {r['row']} | {f['picked']} | {f['pred_memory'] / GiB:.2f} / "
            f"{c['total'] / GiB:.2f} | {_pct(r['summary'].get('f32_memory_err'))} | "
            f"{f['pred_arg_bytes'] / GiB:.2f} / {c['argument'] / GiB:.2f} | "
            f"{c['temp'] / GiB:.2f} |"
        )
    L.append("")
    return L


def _less_copies(f: dict) -> str:
    got = f.get("compiled_memory_less_f32_copies")
    if got is None:
        return "—"
    return f"{got / GiB:.2f} ({_pct(f.get('memory_err_less_f32_copies'))})"


def fidelity_tables(rows) -> list[str]:
    L = [
        "Per compiled plan: predicted vs compiled collective bytes (after the reduce-scatter "
        "reclassification and the bf16 correction), per-device memory (predicted peak vs "
        "`memory_analysis` arguments + outputs + temporaries - aliased), per-device FLOPs "
        "(the cost model's op FLOPs / parallelism vs `cost_analysis`), and compute seconds "
        "(the cost model's per-op roofline sum vs the whole-program roofline of the "
        "compiled counts). Errors are compiled / predicted - 1. *Less f32 copies*: the "
        "compiled memory less what XLA:CPU's f32 copies of bf16 data add to its live peak "
        "(`evaluator.f32_copies_at_peak`, from XLA's buffer assignment and live ranges; "
        "a GPU build computes bf16 dots in bf16 and keeps no such copies).\n",
        "| model | plan | comm MiB pred / compiled | comm err | memory GiB pred / compiled | "
        "memory err | memory GiB less f32 copies (err) | FLOPs err | compute ms pred / "
        "compiled | comm ms pred / compiled |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "summary" not in r:
            continue
        for name, f in r["summary"]["fidelity"].items():
            L.append(
                f"| {r['row']} | {name} | {f['pred_comm_bytes'] / MiB:.0f} / {f['compiled_comm_bytes'] / MiB:.0f} | "
                f"{_pct(f['comm_err'])} | {f['pred_memory'] / GiB:.2f} / {f['compiled_memory'] / GiB:.2f} | "
                f"{_pct(f['memory_err'])} | {_less_copies(f)} | {_pct(f['flops_err'])} | "
                f"{_ms(f['pred_compute_s'])} / {_ms(f['compiled_compute_s'])} | "
                f"{_ms(f['pred_comm_s'])} / {_ms(f['compiled_comm_s'])} |"
            )
    L.append("")
    L += f32_memory_table(rows)
    L.append("### Ranking (Kendall tau, cost model vs compiled)\n")
    L.append(
        "Items: autopar's plans, each compiled: the engines' distinct plans, and autopar's "
        "completion of each baseline's argument specs (`in_specs=` pinned, the rest searched "
        "by `dp`; `pinned:<baseline>`) where it differs from them. *step*: predicted step vs "
        "compiled-priced step (no overlap); *comm*: communication seconds only; *compute*: "
        "predicted compute vs the compiled program's roofline (XLA:CPU's FLOPs and bytes "
        "accessed). *GSPMD*: the engines' plans plus the baselines as `jax.jit` compiles "
        "them, each baseline ranked by autopar's price of its own completion: it measures "
        "how far GSPMD's completion of the same specs lies from autopar's, not the cost "
        "model.\n"
    )
    L.append(
        "| model | plans (engines + pinned) | tau step (all) | tau step (engines) | "
        "tau comm (all) | tau compute (all) | tau step (GSPMD baselines) |"
    )
    L.append("|---|---|---|---|---|---|---|")
    for r in rows:
        if "summary" not in r:
            continue
        s = r["summary"]
        if "kendall_tau_all_step" not in s:
            continue
        n_all = len(s["ranking_items_step"])
        n_plans = sum(1 for p in r["programs"].values() if "priced" in p)
        L.append(
            f"| {r['row']} | {n_plans} + {n_all - n_plans} | {_f(s['kendall_tau_all_step'])} | "
            f"{_f(s['kendall_tau_engines_step'])} | {_f(s['kendall_tau_all_comm'])} | "
            f"{_f(s['kendall_tau_all_compute'])} | {_f(s.get('kendall_tau_gspmd'))} |"
        )
    L.append("")
    return L


def targets(rows) -> list[str]:
    """One line per target: rows met, and each row's figure. Rows without the figure
    count against a target, except the optional checks (`measured_only`), which are
    left out when no row has them."""
    fid = lambda s: s["fidelity"].get(s.get("auto_program", ""), {})
    within = lambda tol: lambda v, r: abs(v) <= tol
    # tau over n items is a ratio of integers: 8/10 arrives as 0.7999999999999999
    at_least = lambda v, r: v >= 0.8 - 1e-9
    fam_target = lambda v, r: v <= TARGET_RATIO.get(r["family"], 1.0)
    checks = [  # (target, figure of a row's summary, met, format, measured_only)
        (
            "**headline: `auto` ≤ 1.0x the stronger baseline (≤ 0.9x MoE, WRN)**; each "
            "baseline at the faster of its GSPMD and autopar lowerings (1c)",
            lambda s: s.get("auto_ratio"),
            fam_target,
            lambda v: _f(v, 3),
            False,
        ),
        (
            "`auto` ≤ 1.0x the stronger baseline, every family (no 0.9x margin)",
            lambda s: s.get("auto_ratio"),
            lambda v, r: v <= 1.0,
            lambda v: _f(v, 3),
            False,
        ),
        (
            "secondary: best engine after compiling (the ILP included, which `auto` never "
            "runs) ≤ 1.0x the stronger baseline (≤ 0.9x MoE, WRN)",
            lambda s: s.get("best_engine_ratio"),
            fam_target,
            lambda v: _f(v, 3),
            False,
        ),
        (
            "lowering finding, not plan quality: `auto` ≤ 1.0x the best GSPMD-lowered "
            "baseline (≤ 0.9x MoE, WRN)",
            lambda s: s.get("auto_ratio_gspmd"),
            fam_target,
            lambda v: _f(v, 3),
            False,
        ),
        (
            "predicted vs compiled collective bytes within 10% (auto's plan)",
            lambda s: fid(s).get("comm_err"),
            within(0.10),
            _pct,
            False,
        ),
        (
            "memory within 15% (auto's plan)",
            lambda s: fid(s).get("memory_err"),
            within(0.15),
            _pct,
            False,
        ),
        (
            "memory within 15%, less XLA:CPU's f32 copies of bf16 data (auto's plan; see 3)",
            lambda s: fid(s).get("memory_err_less_f32_copies"),
            within(0.15),
            _pct,
            True,
        ),
        (
            "memory within 15%, the model in f32 (no CPU bf16 upcast; see 3)",
            lambda s: s.get("f32_memory_err"),
            within(0.15),
            _pct,
            True,
        ),
        (
            "Kendall tau ≥ 0.8 (step; the engines' distinct plans)",
            lambda s: s.get("kendall_tau_engines_step"),
            at_least,
            _f,
            False,
        ),
        (
            "Kendall tau ≥ 0.8 (step; autopar's plans: the engines' and the baselines' "
            "specs completed by autopar)",
            lambda s: s.get("kendall_tau_all_step"),
            at_least,
            _f,
            False,
        ),
    ]
    L = ["| target | rows met | detail |", "|---|---|---|"]
    summarized = [r for r in rows if "summary" in r]
    for target, figure, met, fmt, measured_only in checks:
        got = [(r, figure(r["summary"])) for r in summarized]
        if measured_only:
            got = [(r, v) for r, v in got if v is not None]
            if not got:
                continue
        n_met = sum(v is not None and bool(met(v, r)) for r, v in got)
        detail = "; ".join(f"{r['row']} {fmt(v)}" for r, v in got)
        L.append(f"| {target} | {n_met}/{len(got)} | {detail} |")
    L.append("")
    return L


def plots(out: Path, rows, gpt3) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(matplotlib is not installed: no plots; `pip install -e '.[bench]'`)"]
    made = []
    ok = [r for r in rows if "summary" in r]
    # 1. plan cost vs baselines
    if ok:
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(ok)), 4.5))
        names = sorted(
            {n for r in ok for n in r["programs"]}
            | {f"b:{b}" for r in ok for b in r["baselines"]}
            | {f"p:{b}" for r in ok for b in r["baselines"] if "pinned" in r["baselines"][b]}
        )
        width = 0.8 / max(len(names), 1)
        cmap = plt.get_cmap("tab20")
        for i, n in enumerate(names):
            ys = []
            for r in ok:
                best = r["summary"]["best_baseline_s"]
                if n.startswith("b:"):
                    e = r["baselines"].get(n[2:])
                elif n.startswith("p:"):
                    e = r["baselines"].get(n[2:], {}).get("pinned")
                else:
                    e = r["programs"].get(n)
                ys.append(e["priced"]["step_no_overlap_s"] / best if e and "priced" in e else 0)
            ax.bar(
                [k + i * width for k in range(len(ok))],
                ys,
                width,
                label=n,
                color=cmap(i % 20),
                hatch={"b:": "//", "p:": ".."}.get(n[:2]),
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ok))])
        ax.set_xticklabels([f"{r['row']}\n{r['devices']} dev" for r in ok], fontsize=8)
        ax.set_ylabel("compiled-priced step / stronger baseline")
        ax.set_ylim(0, min(3, max(1.5, ax.get_ylim()[1])))
        ax.legend(fontsize=7, ncol=4)
        ax.set_title(
            "Plan cost vs hand-written baselines (h100-sxm, no overlap; "
            "b: GSPMD lowering, p: autopar lowering)",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(out / "plan_vs_baselines.png", dpi=110)
        plt.close(fig)
        made.append("plan_vs_baselines.png")
    # 2. search time vs graph size and device count
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"recursive": "o", "dp": "s", "auto": "^", "ilp": "D", "data": "v", "fsdp": "<"}
    for eng, mk in markers.items():
        xs, ys, ds, dy = [], [], [], []
        for r in [*ok, *gpt3]:
            v = r["engines"].get(eng)
            if v and "search_s" in v:
                xs.append(r["eqns"])
                ys.append(v["search_s"])
                ds.append(r["devices"])
                dy.append(v["search_s"])
        if xs:
            a1.scatter(xs, ys, marker=mk, label=eng)
            a2.scatter(ds, dy, marker=mk, label=eng)
    for g in gpt3:
        a1.annotate(
            f"175B L{g['layers']}",
            (g["eqns"], max((v.get("search_s", 0) for v in g["engines"].values()), default=0)),
            fontsize=7,
        )
    a1.set_xscale("log")
    a1.set_yscale("log")
    from matplotlib.ticker import NullFormatter

    a1.xaxis.set_minor_formatter(NullFormatter())
    a1.set_xlabel("jaxpr equations (graph size)")
    a1.set_ylabel("search seconds")
    a1.legend(fontsize=8)
    a1.set_title("Search time vs graph size")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("devices")
    a2.set_title("Search time vs device count")
    fig.tight_layout()
    fig.savefig(out / "search_time.png", dpi=110)
    plt.close(fig)
    made.append("search_time.png")
    # 3. predicted vs compiled collective bytes
    if ok:
        fig, ax = plt.subplots(figsize=(5.5, 5))
        fams = sorted({r["family"] for r in ok})
        lo, hi = math.inf, 0
        for fam in fams:
            xs, ys = [], []
            for r in ok:
                if r["family"] != fam:
                    continue
                for f in r["summary"]["fidelity"].values():
                    if f["pred_comm_bytes"] > 0 and f["compiled_comm_bytes"] > 0:
                        xs.append(f["pred_comm_bytes"] / MiB)
                        ys.append(f["compiled_comm_bytes"] / MiB)
            if xs:
                ax.scatter(xs, ys, label=fam)
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
            ax.plot([lo, hi], [lo * 1.1, hi * 1.1], "k:", lw=0.6)
            ax.plot([lo, hi], [lo * 0.9, hi * 0.9], "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("predicted collective MiB / device")
        ax.set_ylabel("compiled collective MiB / device")
        ax.set_title("Collective bytes: cost model vs compiled")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "fidelity_bytes.png", dpi=110)
        plt.close(fig)
        made.append("fidelity_bytes.png")
    return [f"![{m}](results/{m})" for m in made]


METHOD = """\
## How this was measured

* **No GPU cluster.** Each plan is compiled for N simulated CPU devices
  (`--xla_force_host_platform_device_count=16`) from `ShapeDtypeStruct` arguments — no
  weights are allocated — and the compiled program is read (`benchmarks/evaluator.py`):
  every collective from `autopar.tools.hlo.parse_collectives` (kind, bytes of the full-size
  side, mesh axes, link tier via `MeshInfo.is_intra_node`), `cost_analysis()` FLOPs and
  bytes accessed, and `memory_analysis()` per-device bytes.
* **Pricing** on the `h100-sxm` profile with `autopar.cost.model.CostModel`: each collective
  is `alpha + busbw factor x bytes / link bandwidth` (`CostModel.collective`), compute is
  the whole-program roofline `max(FLOPs / (peak x 0.6), bytes / (HBM bw x 0.8))` (a float32 program's dots at the TF32 peak JAX's default precision runs them at: `evaluator.dot_rate`). The
  step is reported without overlap (`compute + comm`, used for all ratios) and with
  perfect overlap (`max`). The CPU compiler's bytes-accessed (its fusion is not a GPU's)
  dominates the compute term, so compute seconds are an estimate; FLOPs agree closely.
* **Reduce-scatter.** The CPU compiler emits all-reduce + dynamic-slice where a GPU build
  emits reduce-scatter. The evaluator *detects the pattern and reclassifies it*: an
  all-reduce (or an element of a combined tuple all-reduce) whose every use keeps at
  most 1/n of the buffer through a dynamic-slice (looking through pure converts) is
  priced as a reduce-scatter of the same full-size bytes (bus factor (n-1)/n instead of
  2(n-1)/n). Unmatched all-reduces stay all-reduces (priced at the full buffer).
* **bf16.** The CPU backend runs bf16 collectives in f32 (convert before/after, or a
  `*_promoted` reducer). Such collectives are counted at bf16 width; genuinely f32 ones
  (softmax statistics, the loss) are not. It also computes bf16 dots and convolutions
  in f32 and keeps f32 copies of their operands and results. Memory is reported as
  compiled and, beside it, *less f32 copies*: each program is compiled with XLA's dump
  on, and `evaluator.f32_copies_at_peak` rebuilds XLA's liveness curve from the dumped
  buffer sizes and live ranges (XLA's own schedule) with and without the copies the CPU
  makes around dots and convolutions: bf16 -> f32 converts that only dots and
  convolutions read, and f32 dot or convolution results whose every user converts them
  back to bf16 (arguments excluded). A copy counts whole when its bf16 value is in
  memory anyway, half when it stands in for a bf16 value a GPU build would write
  instead. The difference of the two curves' maxima comes off `memory_analysis`'s
  total, so XLA's packing overhead stays in.
* **Loops.** Collectives inside `while` bodies are multiplied by the loop's
  `known_trip_count`; the suite's models are unrolled, so there were none.
* **Scaling.** Widths, heads, experts, sequence lengths, vocabularies and images are the
  papers'; *layers* are cut (GPT 2 of 24/32, MoE 2 of 16 — one dense + one MoE layer,
  ViT 2 of 12/24/32, Wide-ResNet one bottleneck block per stage = 14 of 50 layers) and
  the batch is 8 per device (one micro-batch, no gradient accumulation) instead of the
  papers' global 1024-1536. Memory is therefore far below 80 GB on every row and never
  binds the search.
* **Baselines** (`benchmarks/baselines.py`) are plain `jax.jit` in/out shardings built
  from parameter paths; GSPMD propagation decides the rest. DP and FSDP use every device
  for the batch; Megatron splits q/k/v/c_fc by column and o/c_proj by row on `model`
  (vocab-split embedding), batch on `data`; expert parallel splits the expert dim on
  `model` (`expert`) or over all devices (`expert_all`). Each baseline's specs are
  also lowered by autopar (`in_specs=`, the rest searched by `dp`, `pinned:<baseline>`);
  the report compares `auto` with the faster of the two lowerings of every baseline
  (GSPMD's activation layouts alone cost up to 1.9x on WRN-4B), and keeps the GSPMD
  comparison as its own column.
"""


def write(out: Path = RESULTS) -> Path:
    out = Path(out)
    tag, runs, rows, gpt3 = _load(out)
    meta = runs.get(tag, {}).get("meta", {})
    L = ["# autopar benchmarks: plan quality, search speed, cost-model fidelity", ""]
    L.append(
        f"Generated by `python -m benchmarks.run{' --quick' if tag == 'quick' else ''}` "
        f"({tag} run, {meta.get('started', '?')}; JAX {meta.get('jax', '?')}, "
        f"{meta.get('cpus', '?')} CPUs, load average {_f(meta.get('loadavg_start', [None])[0], 1)} at start; "
        f"run wall time {meta.get('wall_s', 0) / 60:.1f} min). "
        "Other runs: "
        + (
            ", ".join(
                f"{t}: {r['meta']['wall_s'] / 60:.1f} min ({len(r['rows'])} rows)"
                for t, r in runs.items()
            )
            or "none"
        )
        + ". Absolute times on this shared machine are noisy; compare ratios measured in one run."
    )
    L.append("")
    L.append("## Targets\n")
    L.append(
        "Plan quality is `auto` (what `parallelize` returns by default) over the stronger "
        "baseline: each hand-written baseline at the faster of its two lowerings, GSPMD's "
        "(`jax.jit`) and autopar's (same argument specs). See section 1.\n"
    )
    L += targets(rows)
    L.append("## 1. Plan quality against hand-written baselines\n")
    L += quality_tables(rows)
    L.append("## 2. Search speed\n")
    L += search_tables(rows, gpt3)
    L.append("## 3. Cost-model fidelity\n")
    L += fidelity_tables(rows)
    L.append("## Plots\n")
    L += plots(out, rows, gpt3)
    L.append("")
    L.append(METHOD)
    disc = HERE / "discussion.md"
    if disc.exists():
        L.append(disc.read_text())
    path = HERE / "REPORT.md" if out.resolve() == RESULTS.resolve() else out / "REPORT.md"
    path.write_text("\n".join(L) + "\n")
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
