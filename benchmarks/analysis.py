"""Summaries of one benchmark row's raw results: ratios to the stronger baseline (each
baseline at the faster of its GSPMD and autopar lowerings) and to the GSPMD one, fidelity of
every compiled plan (predicted vs compiled bytes, memory, flops) and Kendall tau between
the cost model's ranking and the compiled ranking. No JAX needed (the report re-runs it
on stored JSON)."""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import kendalltau


def rel_err(pred, got):
    if pred in (None, 0) or got is None:
        return None
    return got / pred - 1.0


def baseline_lowerings(res: dict) -> dict:
    """Each baseline's argument specs lowered two ways, compiled no-overlap seconds:
    ``gspmd`` (``jax.jit`` with the specs, GSPMD picks every other layout, the baseline
    as written) and ``autopar`` (the same specs as ``in_specs=``, the rest searched by
    ``dp`` and lowered by autopar: ``pinned:<baseline>``, or the engine plan it equals).
    ``program`` names the autopar lowering's program; ``stronger`` the faster lowering."""
    step = lambda e: e["priced"]["step_no_overlap_s"] if e and "priced" in e else math.inf
    progs = autopar_programs(res)
    out = {}
    for b, e in res["baselines"].items():
        prog = f"pinned:{b}" if "pinned" in e else e.get("pinned_program")
        d = {"gspmd_s": step(e), "autopar_s": step(progs.get(prog)), "program": prog}
        d["stronger"] = "autopar" if d["autopar_s"] < d["gspmd_s"] else "gspmd"
        d["s"] = min(d["gspmd_s"], d["autopar_s"])
        out[b] = d
    return out


def summarize_row(res: dict) -> None:
    """Ratios to the stronger baseline (and to the GSPMD-lowered one), fidelity of the
    chosen plan, and Kendall tau.

    The headline is ``auto_ratio``: auto's plan (what ``parallelize`` returns by default)
    over the fastest baseline, each baseline taken at the faster of its two lowerings
    (``baseline_lowerings``). ``auto_ratio_gspmd`` divides by the fastest baseline as
    ``jax.jit`` lowers it (GSPMD picks the activation layouts): a finding about lowering,
    not plan quality. ``best_engine_ratio`` is the fastest engine plan once compiled
    (the ILP included, which auto never runs): a secondary figure."""
    step = lambda e: e["priced"]["step_no_overlap_s"] if "priced" in e else math.inf
    lowerings = baseline_lowerings(res)
    gspmd = {k: v["gspmd_s"] for k, v in lowerings.items() if math.isfinite(v["gspmd_s"])}
    strong = {k: v["s"] for k, v in lowerings.items() if math.isfinite(v["s"])}
    progs = {k: step(v) for k, v in res["programs"].items() if "priced" in v}
    best_gspmd = min(gspmd.items(), key=lambda kv: kv[1]) if gspmd else (None, math.inf)
    best_base = min(strong.items(), key=lambda kv: kv[1]) if strong else (None, math.inf)
    auto = res["engines"].get("auto", {})
    auto_prog = auto.get("program")
    s: dict = {
        "baseline_lowerings": lowerings,
        "best_baseline": best_base[0],
        "best_baseline_lowering": lowerings[best_base[0]]["stronger"] if strong else None,
        "best_baseline_s": best_base[1],
        "best_gspmd_baseline": best_gspmd[0],
        "best_gspmd_baseline_s": best_gspmd[1],
    }
    if auto_prog in progs:
        s["auto_program"] = auto_prog
        s["auto_s"] = progs[auto_prog]
        s["auto_ratio"] = progs[auto_prog] / best_base[1]
        s["auto_ratio_gspmd"] = progs[auto_prog] / best_gspmd[1]
    if progs:
        best = min(progs.items(), key=lambda kv: kv[1])
        s["best_engine_program"] = best[0]
        s["best_engine_s"] = best[1]
        s["best_engine_ratio"] = best[1] / best_base[1]
        s["best_engine_ratio_gspmd"] = best[1] / best_gspmd[1]
    # Compute floor: the lowest compiled compute term of any program measured (plans,
    # baselines, autopar's lowerings of the baselines' specs), with no communication at
    # all, over the stronger baseline. A plan scores below it only by computing less than
    # every program seen.
    priced = [
        v["priced"]
        for v in [*autopar_programs(res).values(), *res["baselines"].values()]
        if "priced" in v
    ]
    if priced and strong:
        least_compute = min(p["compute_s"] for p in priced)
        s["compute_floor_ratio"] = least_compute / best_base[1]
        # ... and with the least communication of any program measured added.
        s["floor_ratio"] = (least_compute + min(p["comm_s"] for p in priced)) / best_base[1]
    # Overlap variant of the same ratios.
    ov = lambda e: e["priced"]["step_overlap_s"] if e and "priced" in e else math.inf
    pinned_progs = autopar_programs(res)
    bo = min(
        (
            min(ov(res["baselines"][b]), ov(pinned_progs.get(d["program"])))
            for b, d in lowerings.items()
        ),
        default=math.inf,
    )
    if auto_prog in res["programs"]:
        s["auto_ratio_overlap"] = ov(res["programs"][auto_prog]) / bo
    # Fidelity of every compiled plan: predicted vs compiled bytes, memory, flops.
    fid = {}
    for name, p in autopar_programs(res).items():
        if "measured" not in p:
            continue
        pred, meas = p["predicted"], p["measured"]
        pb = sum(pred["comm_bytes"].values())
        fid[name] = {
            "pred_comm_by_key": norm_comm(pred["comm_bytes"], list(res["mesh"])),
            "compiled_comm_by_key": meas["comm_bytes"],
            "pred_comm_bytes": pb,
            "compiled_comm_bytes": meas["total_comm_bytes"],
            "comm_err": rel_err(pb, meas["total_comm_bytes"]),
            "pred_memory": pred["peak_memory_bytes"],
            "compiled_memory": meas["memory"]["total"],
            "memory_err": rel_err(pred["peak_memory_bytes"], meas["memory"]["total"]),
            "compiled_memory_less_f32_copies": meas["memory"].get("less_f32_copies"),
            "memory_err_less_f32_copies": rel_err(
                pred["peak_memory_bytes"], meas["memory"].get("less_f32_copies")
            ),
            "pred_arg_bytes": pred["argument_bytes"],
            "compiled_arg_bytes": meas["memory"]["argument"],
            "pred_flops": p.get("predicted_flops"),
            "compiled_flops": meas["flops"],
            "flops_err": rel_err(p.get("predicted_flops"), meas["flops"]),
            "pred_step_s": pred["step_s"],
            "compiled_step_s": p["priced"]["step_no_overlap_s"],
            "pred_comm_s": pred["comm_s"],
            "compiled_comm_s": p["priced"]["comm_s"],
            "pred_compute_s": pred["compute_s"],
            "compiled_compute_s": p["priced"]["compute_s"],
        }
    s["fidelity"] = fid
    f32 = res.get("f32_memory", {})
    if "compiled" in f32:
        s["f32_memory_err"] = rel_err(f32["pred_memory"], f32["compiled"]["total"])
    # Kendall tau: the cost model's ranking vs the compiled ranking, over autopar's plans
    # (the engines' and the completions of the baselines' argument specs), each compared
    # with its own compiled program.
    progs_all = {n: p for n, p in autopar_programs(res).items() if "priced" in p}
    terms = {  # term: (predicted key, compiled key)
        "step": ("step_s", "step_no_overlap_s"),
        "comm": ("comm_s", "comm_s"),
        "compute": ("compute_s", "compute_s"),
    }
    for term, (pk, ck) in terms.items():
        items = [(n, p["predicted"][pk], p["priced"][ck]) for n, p in progs_all.items()]
        eng = [i for i in items if i[0] in res["programs"]]
        s[f"ranking_items_{term}"] = items
        s[f"kendall_tau_all_{term}"] = _tau(items)
        s[f"kendall_tau_engines_{term}"] = _tau(eng)
    # The same cost-model prices against GSPMD's programs for the baselines' specs: how
    # far GSPMD's completion is from autopar's (not a check of the cost model).
    gspmd = [
        (f"baseline:{b}", e["autopar_priced"]["step_s"], step(e))
        for b, e in res["baselines"].items()
        if "priced" in e and "autopar_priced" in e
    ]
    s["kendall_tau_gspmd"] = _tau(
        [
            (n, p["predicted"]["step_s"], p["priced"]["step_no_overlap_s"])
            for n, p in res["programs"].items()
            if "priced" in p
        ]
        + gspmd
    )
    res["summary"] = s


def autopar_programs(res: dict) -> dict:
    """Every compiled autopar program of a row: the engines' distinct plans, then
    autopar's completions of the baselines' argument specs (``pinned:<baseline>``) that
    differ from them."""
    out = dict(res["programs"])
    for b, e in res["baselines"].items():
        if "pinned" in e:
            out[f"pinned:{b}"] = e["pinned"]
    return out


def norm_comm(comm: dict, axis_order) -> dict:
    """``kind@axes`` keys with the axes in mesh order (the cost model may print
    ``model,data``), summed."""
    out: dict = {}
    for k, v in comm.items():
        kind, _, axes = k.partition("@")
        order = sorted(
            axes.split(","), key=lambda a: list(axis_order).index(a) if a in axis_order else 99
        )
        key = f"{kind}@{','.join(order)}"
        out[key] = out.get(key, 0) + v
    return dict(sorted(out.items()))


def _tau(items):
    if len(items) < 3:
        return None
    t = kendalltau([i[1] for i in items], [i[2] for i in items]).statistic
    return None if t is None or np.isnan(t) else float(t)
