"""How far ``dp`` and ``recursive`` are from the ILP optimum.

Run: ``python -m benchmarks.optimality [--quick]``.

The target (issue "Search engines"): on graphs small enough for the ILP to prove
optimality within its limit, ``dp`` within 1% of the ILP optimum and ``recursive``
within 10%, on the meshes (8,), (2,4) and (2,2,2).

Models. Widths are those of the smallest suite row of each family
(``benchmarks/suite.py``, the published shapes); only depth is cut, to the counts
the issue names; batch is the suite's 8 per device, 64 on the 8 devices:

* GPT 2, 3 and 4 layers at GPT-1.3B widths: hidden 2048, 32 heads, seq 1024,
  vocab 51200, bfloat16;
* MoE 2 layers (one dense + one MoE layer, the GShard pair) at MoE-1.3B widths:
  hidden 768, 16 heads, 16 experts, FFN 6144, top-2, expert group 2048, seq 1024,
  vocab 32000;
* one Wide-ResNet bottleneck block (``stage_sizes=(1,)``: stem, one block, head) at
  WRN-1B widths: base 320 filters, width 2, 224x224x3 images, 1024 classes;
* ViT 2 layers at ViT-B/16 widths: hidden 768, MLP 3072, 12 heads, patch 16,
  224x224 images, 1000 classes.

Why these: the ILP's size is set by the number of ops and of strategies per op,
not by the widths, so the published widths cost nothing extra and keep the
cost model's compute/bandwidth/latency trade-offs realistic. (At toy widths every
op is latency-bound and the optimum is to replicate everything, a different
problem; the full run adds such rows, marked as extra: the GPT of
``tests/test_optimality.py``, and a Llama and a GPT-2 written as public Flax code
writes them, ``benchmarks/user_models_defs.py``, at width 64 with 4 layers.) On (8,) and (2,4) the ILP proves optimality in seconds to tens of
seconds here. On (2,2,2) every op has up to ~300 strategies and the ILP has 3.7M
(ViT) to 23M (GPT 4 layers) variables. Measured on this 2-core, 23 GB machine: at
3.7M (ViT) HiGHS stops at the 120 s limit with a useless dual bound (99.9% gap) and
the process peaks at 10 GB; at 12M (GPT 2 layers) it stops at the limit with no
bound at all; at 17M (GPT 3 layers) it ran the machine out of memory. So the ILP
is run only below ``--max-ilp-vars`` (default 4M) and the other cases are
reported against the best plan any engine found and a provable lower bound,
never as optimal.

Search. Each (model, mesh) problem is built once, as ``autopar.parallelize`` does
(``capture`` -> ``mesh_info`` -> ``build_problem``), and every engine runs on that
same problem through ``autopar.search.search`` with no memory budget
(``math.inf``), so no memory term constrains or perturbs any engine. The ILP is
the ``ilp`` engine (HiGHS, warm-started with the ``recursive`` plan) with its time
limit set to ``--time-limit`` (120 s; 60 s with ``--quick``).

Measured per engine: the search objective (``total_time``, what every engine
minimizes), ``evaluate``'s step time (reshards of one value to one spec counted
once), the search seconds (``SearchResult.seconds``), and the solver's own report
(``optimal``/``gap``; ``dp`` says whether its elimination was exact). Where the
ILP proved optimality, ``step_ratio_to_ilp_optimum`` compares the step times too.

Reference. Where the ILP proved optimality, ratios are ``objective / ILP
optimum``. Elsewhere the reference is the best plan any of the three engines
found (``best_known``) and the bound is the larger of the ILP's dual bound and
the trivial bound (every node's cheapest strategy plus every edge's cheapest
entry, after the cost graph's presolve); a target then counts as *met* only if
``objective / bound`` is within it, as *missed* if ``objective / best_known``
already exceeds it, and as *unknown* otherwise.

Output: ``benchmarks/results/optimality.json`` and ``optimality.md``
(``optimality.quick.*`` with ``--quick``), rewritten after every case.
"""

from __future__ import annotations

import os

_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_DEVICES}"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

import autopar.search as search_mod  # noqa: E402
import cost_models  # noqa: E402
from autopar import examples  # noqa: E402
from autopar.cost.model import CostModel  # noqa: E402
from autopar.ir.capture import capture  # noqa: E402
from autopar.ir.graph import Graph  # noqa: E402
from autopar.meshes import make_mesh  # noqa: E402
from autopar.search import search  # noqa: E402
from autopar.search.evaluate import total_time  # noqa: E402
from autopar.search.problem import Problem, build_problem  # noqa: E402
from autopar.sharding import mesh_info  # noqa: E402
from benchmarks import suite  # noqa: E402

PROFILE = "h100-sxm"
RESULTS = Path(__file__).resolve().parent / "results"
MESHES: dict[str, dict[str, int]] = {
    "(8,)": {"data": 8},
    "(2,4)": {"data": 2, "model": 4},
    "(2,2,2)": {"data": 2, "model": 2, "expert": 2},
}
ENGINES = ("recursive", "dp", "ilp")
TARGETS = {"dp": 0.01, "recursive": 0.10}  # allowed excess over the optimum
BATCH = suite.PER_DEVICE_BATCH * _DEVICES
DEFAULT_MAX_ILP_VARS = 4_000_000
# Relative slack when comparing objectives: HiGHS proves optimality to its
# feasibility tolerances, so an engine may come out a hair below the "optimum".
RTOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    shape: str  # what the docstring and the table say about it
    make: Callable[[], tuple[Callable, tuple]]  # -> (train step, abstract args)
    extra: bool = False  # not part of the matrix


def _suite_model(row_name: str, label: str, shape: str, **overrides) -> Model:
    row = next(r for r in suite.ROWS if r.name == row_name)

    def make():
        cfg = dataclasses.replace(row.config, batch_size=BATCH, **overrides)
        return row.module.make_train_step(cfg).step, row.module.abstract_args(cfg)

    return Model(label, shape, make)


def _tiny_gpt() -> Model:
    def make():
        w = examples.gpt(hidden=64, layers=1, heads=4, seq=32, vocab=256, batch=16)
        return w.fn, w.args

    return Model(
        "gpt-tiny-L1",
        "hidden 64, 4 heads, seq 32, vocab 256, batch 16, fp32 (tests/test_optimality.py)",
        make,
        extra=True,
    )


TINY_USER = dict(batch=8, seq=32, vocab=128, d=64, heads=4, kv_heads=2, ffn=176, layers=4)


def _user_model(name: str, label: str, cfg: dict, shape: str) -> Model:
    """A decoder written as public Flax code writes it (`benchmarks.user_models_defs`)."""

    def make():
        from benchmarks.user_models_defs import MODELS

        case = MODELS[name][0](cfg)
        return case.step, case.args(concrete=False)

    return Model(label, shape, make, extra=True)


def _user_models() -> list[Model]:
    tiny = "width 64, 4 heads, seq 32, vocab 128, batch 8, 4 layers, fp32, AdamW"
    return [
        _user_model("llama", "llama-user-tiny", TINY_USER, f"Llama (RoPE, GQA 4/2), {tiny}"),
        _user_model("gpt2", "gpt2-user-tiny", TINY_USER, f"GPT-2 (tied, fused qkv), {tiny}"),
    ]


GPT_SHAPE = "GPT-1.3B widths: hidden 2048, 32 heads, seq 1024, vocab 51200, batch 64, bf16"


def models(quick: bool) -> list[Model]:
    gpt = [
        _suite_model("gpt-1.3b", f"gpt-L{n}", f"{GPT_SHAPE}, {n} layers", layers=n)
        for n in (2, 3, 4)
    ]
    moe = _suite_model(
        "moe-1.3b",
        "moe-L2",
        "MoE-1.3B widths: hidden 768, 16 heads, 16 experts, FFN 6144, group 2048, "
        "seq 1024, vocab 32000, batch 64, bf16, 2 layers (dense + MoE)",
        layers=2,
    )
    wrn = _suite_model(
        "wrn-1b",
        "wrn-block",
        "WRN-1B widths: base 320, width 2, 224x224x3, 1024 classes, batch 64, bf16; "
        "stem + one bottleneck block + head",
        stage_sizes=(1,),
    )
    vit = _suite_model(
        "vit-b16",
        "vit-L2",
        "ViT-B/16 widths: hidden 768, MLP 3072, 12 heads, patch 16, 224x224, "
        "1000 classes, batch 64, bf16, 2 layers",
        layers=2,
    )
    if quick:
        return [gpt[0], wrn, vit]
    return [*gpt, moe, wrn, vit, _tiny_gpt(), *_user_models()]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_problem(graph: Graph, mesh: dict[str, int], profile) -> Problem:
    """The search problem as ``autopar.parallelize`` builds it."""
    info = mesh_info(make_mesh(mesh), profile.devices_per_node)
    return build_problem(graph, info, CostModel(profile, info))


def ilp_variables(problem: Problem) -> int:
    """Columns of the ILP: one per strategy plus one per entry of every edge matrix
    that survives the cost graph's presolve (as ``solve_ilp`` builds it)."""
    cost, edges = problem.cost_graph().presolve()
    return sum(len(c) for c in cost) + sum(m.size for m in edges.values())


def trivial_lower_bound(problem: Problem) -> float:
    """Every node at its cheapest strategy plus every edge at its cheapest entry
    (after presolve): no plan costs less."""
    cost, edges = problem.cost_graph().presolve()
    return math.fsum(float(c.min()) for c in cost) + math.fsum(
        float(m.min()) for m in edges.values()
    )


def run_engine(problem: Problem, engine: str) -> dict[str, Any]:
    res = search(problem, engine, math.inf)
    info = res.solver_info.get(engine, {})
    return {
        "objective_s": total_time(problem, res.choice),
        "step_s": res.cost.step_s,
        "compute_s": res.cost.compute_s,
        "comm_s": res.cost.comm_s,
        "peak_memory_bytes": res.cost.peak_memory_bytes,
        "seconds": res.seconds,
        "solver_info": {
            k: (v if isinstance(v, bool | int | float | None) else str(v)) for k, v in info.items()
        },
    }


def _verdict(
    objective: float, excess: float, optimum: float | None, best: float, bound: float
) -> str:
    limit = 1 + excess + RTOL
    if optimum is not None:
        return "met" if objective <= limit * optimum else "missed"
    if bound > 0 and objective <= limit * bound:
        return "met"
    if objective > limit * best:
        return "missed"
    return "unknown"


def run_case(model: Model, graph: Graph, mesh_name: str, profile, max_ilp_vars: int) -> dict:
    t = time.perf_counter()
    problem = make_problem(graph, MESHES[mesh_name], profile)
    build_s = time.perf_counter() - t
    n_vars = ilp_variables(problem)
    case: dict[str, Any] = {
        "model": model.name,
        "shape": model.shape,
        "extra": model.extra,
        "mesh": mesh_name,
        "mesh_axes": MESHES[mesh_name],
        "ops": len(graph.nodes),
        "cost_graph_nodes": len(problem.strategies),
        "strategies": sum(len(s) for s in problem.strategies),
        "max_strategies_per_node": max(len(s) for s in problem.strategies),
        "edges": len(problem.edges),
        "ilp_variables": n_vars,
        "build_s": build_s,
        "trivial_lower_bound_s": trivial_lower_bound(problem),
        "engines": {},
    }
    log(
        f"{model.name} {mesh_name}: {case['ops']} ops, {case['strategies']} strategies, "
        f"{n_vars / 1e6:.2f}M ILP variables (built in {build_s:.1f}s)"
    )
    for engine in ENGINES:
        if engine == "ilp" and n_vars > max_ilp_vars:
            case["engines"]["ilp"] = {
                "skipped": f"{n_vars / 1e6:.1f}M ILP variables > --max-ilp-vars "
                f"{max_ilp_vars / 1e6:.1f}M (memory)"
            }
            log(f"  ilp skipped: {case['engines']['ilp']['skipped']}")
            continue
        r = run_engine(problem, engine)
        case["engines"][engine] = r
        log(
            f"  {engine}: objective {r['objective_s'] * 1e3:.4f} ms in {r['seconds']:.1f}s "
            f"{r['solver_info']}"
        )
    summarize(case)
    return case


def summarize(case: dict) -> None:
    """Reference, bound, ratios and verdicts, from the engines' results."""
    eng = case["engines"]
    ran = {k: v for k, v in eng.items() if "objective_s" in v}
    ilp = eng.get("ilp", {})
    info = ilp.get("solver_info", {})
    proven = bool(info.get("optimal"))
    best = min(v["objective_s"] for v in ran.values())
    bound = case["trivial_lower_bound_s"]
    ilp_bound = None
    if "objective_s" in ilp and info.get("gap") is not None:
        ilp_bound = ilp["objective_s"] * (1 - float(info["gap"]))
        bound = max(bound, ilp_bound)
    optimum = ilp["objective_s"] if proven else None
    ref = optimum if proven else best
    case["ilp_status"] = (
        "optimal"
        if proven
        else "skipped"
        if "skipped" in ilp
        else f"not proven (status {info.get('status')}, gap {info.get('gap')})"
    )
    case["reference"] = {
        "kind": "ilp_optimum" if proven else "best_known",
        "objective_s": ref,
        "lower_bound_s": optimum if proven else bound,
        "ilp_dual_bound_s": ilp_bound,
    }
    ilp_step = ilp["step_s"] if proven else None  # evaluate() of the optimal plan
    for name in ("dp", "recursive"):
        r = ran[name]
        r["ratio"] = r["objective_s"] / ref
        r["ratio_to_lower_bound"] = (
            r["objective_s"] / case["reference"]["lower_bound_s"]
            if case["reference"]["lower_bound_s"] > 0
            else None
        )
        r["step_ratio_to_ilp_optimum"] = r["step_s"] / ilp_step if ilp_step else None
        r["target"] = TARGETS[name]
        r["verdict"] = _verdict(r["objective_s"], TARGETS[name], optimum, best, bound)


# ---- output ---------------------------------------------------------------------------


def _fmt_ratio(r: dict, proven: bool) -> str:
    if proven:
        return f"{r['ratio']:.4f}"
    ub = r.get("ratio_to_lower_bound")
    return f"{r['ratio']:.4f} (≤{ub:.2f})" if ub else f"{r['ratio']:.4f}"


def _ilp_cells(case: dict) -> tuple[str, str]:
    ilp = case["engines"]["ilp"]
    if "skipped" in ilp:
        return f"not run: {case['ilp_variables'] / 1e6:.1f}M vars", "—"
    info = ilp["solver_info"]
    if info.get("optimal"):
        return "optimal (gap 0)", f"{ilp['seconds']:.1f}"
    gap = info.get("gap")
    gap_s = "no bound" if gap is None else f"gap {100 * gap:.1f}%"
    return f"time limit, {gap_s}", f"{ilp['seconds']:.1f}"


def markdown(meta: dict, cases: list[dict]) -> str:
    lines = [
        "# Optimality: `dp` and `recursive` against the ILP",
        "",
        f"Generated by `python -m benchmarks.optimality{' --quick' if meta['quick'] else ''}` "
        f"on {meta['started']} ({meta['cpus']} CPUs, load {meta['loadavg_start'][0]:.1f}; "
        f"autopar at {meta['git']['head'][:12]}"
        + (
            f", uncommitted changes in {', '.join(meta['git']['dirty'])}"
            if meta["git"]["dirty"]
            else ""
        )
        + f"). Cost profile `{meta['profile']}`, no memory budget, ILP time limit "
        f"{meta['time_limit_s']:.0f} s, ILP run up to {meta['max_ilp_vars'] / 1e6:.1f}M variables. "
        "Shapes, method and the meaning of each column: the docstring of "
        "`benchmarks/optimality.py`.",
        "",
        "Ratio = the engine's search objective (`total_time`) / the reference: the ILP "
        "optimum where the ILP proved optimality, otherwise the best plan any engine found, "
        "with `(≤x)` = objective / the best provable lower bound (the most the engine can "
        "be off). Targets: `dp` ≤ 1.01, `recursive` ≤ 1.10; *met*/*missed* are proven, "
        "*unknown* means the bound is too weak to tell.",
        "",
        "| model | mesh | #ops | #strategies | ILP status | ILP s | dp ratio | dp s | "
        "recursive ratio | recursive s | target met? (dp / recursive) |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for extra in (False, True):
        rows = [c for c in cases if c["extra"] == extra and "error" not in c]
        if extra and rows:
            lines.append("| *extra, not in the issue's matrix:* | | | | | | | | | | |")
        for c in rows:
            proven = c["reference"]["kind"] == "ilp_optimum"
            status, ilp_s = _ilp_cells(c)
            dp, rec = c["engines"]["dp"], c["engines"]["recursive"]
            lines.append(
                f"| {c['model']} | {c['mesh']} | {c['ops']} | {c['strategies']} | {status} | "
                f"{ilp_s} | {_fmt_ratio(dp, proven)} | {dp['seconds']:.1f} | "
                f"{_fmt_ratio(rec, proven)} | {rec['seconds']:.1f} | "
                f"{dp['verdict']} / {rec['verdict']} |"
            )
    errors = [c for c in cases if "error" in c]
    for c in errors:
        lines.append(f"\n{c['model']} {c['mesh']}: error {c['error']}")
    main_cases = [c for c in cases if not c["extra"] and "error" not in c]
    lines += ["", "## Summary", ""]
    for name in ("dp", "recursive"):
        verdicts = [c["engines"][name]["verdict"] for c in main_cases]
        proven = [
            c["engines"][name]["ratio"]
            for c in main_cases
            if c["reference"]["kind"] == "ilp_optimum"
        ]
        worst = f", worst proven ratio {max(proven):.4f}" if proven else ""
        lines.append(
            f"* `{name}` (target ≤ {1 + TARGETS[name]:.2f}): met {verdicts.count('met')}, "
            f"missed {verdicts.count('missed')}, unknown {verdicts.count('unknown')} "
            f"of {len(verdicts)}{worst}."
        )
    exact = sum(bool(c["engines"]["dp"]["solver_info"].get("optimal")) for c in main_cases)
    lines.append(f"* `dp` reported itself exact on {exact} of {len(main_cases)} cases.")
    lines += ["", "## Models", ""]
    seen = set()
    for c in cases:
        if c["model"] not in seen:
            seen.add(c["model"])
            lines.append(f"* `{c['model']}`: {c['shape']}; {c['ops']} ops.")
    lines.append("")
    return "\n".join(lines)


def git_state() -> dict:
    root = Path(__file__).resolve().parent.parent

    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    dirty = [ln[3:] for ln in git("status", "--porcelain", "autopar").splitlines()]
    return {"head": git("rev-parse", "HEAD").strip(), "dirty": dirty}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="GPT 2 layers, WRN block, ViT 2 layers on (8,), (2,4)"
    )
    ap.add_argument("--time-limit", type=float, default=None, help="ILP seconds (120; 60 quick)")
    ap.add_argument(
        "--max-ilp-vars",
        type=float,
        default=DEFAULT_MAX_ILP_VARS,
        help="skip the ILP above this many variables (memory: ~2.5 kB each)",
    )
    ap.add_argument("--models", default="", help="comma-separated model names (default: all)")
    ap.add_argument("--meshes", default="", help="space-separated mesh names, e.g. '(8,) (2,4)'")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ns = ap.parse_args(argv)
    time_limit = ns.time_limit or (60.0 if ns.quick else 120.0)
    search_mod.ILP_TIME_LIMIT_S = time_limit  # what the `ilp` engine passes to HiGHS
    meshes = [m for m in MESHES if m != "(2,2,2)"] if ns.quick else list(MESHES)
    if ns.meshes:
        meshes = ns.meshes.split()
        if unknown := [m for m in meshes if m not in MESHES]:
            ap.error(f"unknown meshes {unknown}; choose from {' '.join(MESHES)}")
    chosen = models(ns.quick)
    if ns.models:
        want = ns.models.split(",")
        chosen = [m for m in models(False) if m.name in want]
        if unknown := sorted(set(want) - {m.name for m in chosen}):
            ap.error(f"unknown models {unknown}; choose from {[m.name for m in models(False)]}")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "optimality.quick" if ns.quick else "optimality"
    profile = cost_models.load(PROFILE)
    meta = {
        "quick": ns.quick,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "profile": PROFILE,
        "memory_budget": "none (math.inf)",
        "time_limit_s": time_limit,
        "max_ilp_vars": int(ns.max_ilp_vars),
        "batch": BATCH,
        "targets": TARGETS,
        "git": git_state(),
    }
    t0 = time.perf_counter()
    cases: list[dict] = []
    for model in chosen:
        t = time.perf_counter()
        fn, args = model.make()
        graph = capture(fn, args)
        log(f"{model.name}: captured {len(graph.nodes)} ops in {time.perf_counter() - t:.1f}s")
        for mesh_name in meshes:
            try:
                cases.append(run_case(model, graph, mesh_name, profile, int(ns.max_ilp_vars)))
            except Exception as e:  # noqa: BLE001 - record and go on
                log(f"{model.name} {mesh_name}: {type(e).__name__}: {e}")
                cases.append(
                    {
                        "model": model.name,
                        "mesh": mesh_name,
                        "extra": model.extra,
                        "error": f"{type(e).__name__}: {e}",
                    }
                )
            meta["wall_s"] = time.perf_counter() - t0
            meta["loadavg_end"] = os.getloadavg()
            (out / f"{stem}.json").write_text(
                json.dumps({"meta": meta, "cases": cases}, indent=1, default=str) + "\n"
            )
            (out / f"{stem}.md").write_text(markdown(meta, cases))
    log(f"done in {time.perf_counter() - t0:.0f}s: {out / stem}.json, .md")
    print((out / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
