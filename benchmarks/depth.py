"""Search time against depth on layers unrolled in Python: a Llama-style step (7B
widths: hidden 4096, 32 heads, MLP 11008, bf16, abstract arguments) with 8, 16, 32
and 64 unrolled layers, `auto` on data 32 x model 8, the engines searching the
problem folded to three layers (`autopar.search.fold`) and, side by side in the same
process, the whole problem (`fold.ENABLED = False`, as before the fold). The engines
run inline (`AUTOPAR_WORKERS=1`), so each one's phase is its own seconds; `.plan()`
is timed from cleared JAX trace caches.

    python -m benchmarks.depth [--layers 8 16 32 64]

Writes benchmarks/results/depth.md (and .json)."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["AUTOPAR_WORKERS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

import autopar  # noqa: E402
from autopar.search import fold  # noqa: E402
from benchmarks.plan_time import llama_7b  # noqa: E402

OUT = Path(__file__).parent / "results" / "depth"
MESH = {"data": 32, "model": 8}
ENGINES = ("recursive", "dp", "data", "seed")  # `seed`: dp on the merged mesh
PRICING = ("polish", "evaluate")


def measure(layers: int, folded: bool) -> dict:
    fn, args = llama_7b(layers=layers)
    fold.ENABLED = folded
    jax.clear_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        plan = autopar.parallelize(fn, mesh=MESH, engine="auto", memory_budget=1e15).plan(*args)
        wall = time.perf_counter() - t
    ph = dict(plan.phases)
    return {
        "layers": layers,
        "folded": folded,
        "plan_s": wall,
        "engines_s": sum(ph.get(k, 0.0) for k in ENGINES),
        "pricing_s": sum(ph.get(k, 0.0) for k in PRICING),
        "phases": ph,
        "step_ms": plan.cost.step_s * 1e3,
        "engine": plan.engine,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[8, 16, 32, 64])
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    rows = []
    for n in a.layers:
        for folded in (True, False):
            rows.append(measure(n, folded))
            r = rows[-1]
            print(
                f"{n} layers, folded={folded}: .plan() {r['plan_s']:.2f} s, engines "
                f"{r['engines_s']:.2f} s, polish+evaluate {r['pricing_s']:.2f} s, "
                f"{r['step_ms']:.3f} ms ({r['engine']})",
                flush=True,
            )
    fold.ENABLED = True
    lines = [
        "# Search time against depth (layers unrolled in Python)",
        "",
        "`python -m benchmarks.depth`: " + __doc__.split("\n\n")[0].replace("\n", " "),
        "",
        f"Machine: {os.cpu_count()} CPUs, JAX {jax.__version__}.",
        "",
        "| layers | engines search | `.plan()` s | capture s | build s | engines s "
        "(recursive, dp, data, seed) | polish + evaluate s | predicted step ms | plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ph = r["phases"]
        lines.append(
            f"| {r['layers']} | {'folded' if r['folded'] else 'whole'} | {r['plan_s']:.2f} | "
            f"{ph.get('capture', 0):.2f} | {ph.get('build', 0):.2f} | {r['engines_s']:.2f} "
            f"({', '.join(f'{ph.get(k, 0):.2f}' for k in ENGINES)}) | {r['pricing_s']:.2f} | "
            f"{r['step_ms']:.3f} | {r['engine']} |"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
