"""Search time with the layers under `scan`: GPT-3 175B shapes (hidden 12288, 96 heads,
seq 2048, batch 1536, bf16, AdamW), layers run by `nn.scan` (`GPTConfig.scan_layers`),
planned on the abstract 1024-device mesh {"data": 128, "model": 8} (h100-sxm profile, as
`benchmarks.scale`; no memory budget: this measures search time, and 175B does not fit
80 GB without pipelining, see the README). The scan bodies (forward and backward layer) are searched
once whatever the depth, so 96 layers should cost about what 12 do.

Run: `python -m benchmarks.scan_scale` (writes benchmarks/results/scan_scale.json).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "scan_scale.json"
MESH = {"data": 128, "model": 8}


def measure(layers: int, engine: str) -> dict:
    import dataclasses

    import jax

    import autopar
    from autopar.examples.models import gpt
    from benchmarks import suite

    cfg = dataclasses.replace(suite.gpt3(layers).config, batch_size=1536, scan_layers=True)
    ts = gpt.make_train_step(cfg)
    args = gpt.abstract_args(cfg)
    t = time.perf_counter()
    jaxpr = jax.make_jaxpr(ts.step)(*args)
    trace_s = time.perf_counter() - t
    step = autopar.parallelize(
        ts.step, mesh=MESH, cluster="h100-sxm", engine=engine, memory_budget=1e15
    )
    t = time.perf_counter()
    plan = step.plan(*args)
    plan_s = time.perf_counter() - t
    return {
        "layers": layers,
        "engine": engine,
        "picked": plan.engine,
        "outer_eqns": len(jaxpr.eqns),
        "trace_s": round(trace_s, 3),
        "plan_s": round(plan_s, 3),  # trace + problem build + search (bodies included)
        "search_s": round(plan.search_seconds, 3),
        "predicted_step_s": plan.cost.step_s,
    }


def main() -> int:
    rows = []
    for engine in ("recursive", "dp"):
        for layers in (12, 96):
            rows.append(measure(layers, engine))
            print(json.dumps(rows[-1]), flush=True)
    ratios = {}
    for engine in ("recursive", "dp"):
        by = {r["layers"]: r for r in rows if r["engine"] == engine}
        ratios[engine] = by[96]["plan_s"] / by[12]["plan_s"]
    out = {"mesh": MESH, "rows": rows, "plan_s_ratio_96_over_12": ratios}
    print(json.dumps(ratios))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
