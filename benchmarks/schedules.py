"""Pipeline schedules side by side: GPipe, lock-step 1F1B, the alternating 1F1B,
ZB-H1 (lock-step 1F1B with the weight gradients deferred) and interleaved 1F1B (2
virtual stages per stage; `pipeline_schedule=`), each planned by
`autopar.parallelize` in one process.

* **compiled**: a 4-layer GPT (`autopar.examples.gpt`, hidden 64, seq 64, batch 32,
  scanned layers) on `{"stage": 4, "data": 2}` and on `{"stage": 2, "data": 4}` (where
  the interleaved schedule's 2 chunks of a stage's layers fit) with 16 and 8 micro-batches
  (micro-batches of 2 and 4 examples, a data-axis' worth), on this
  machine's simulated CPU devices: the micro-batches each stage holds, the predicted
  peak (and its part above the arguments) against XLA's compiled temporaries (its
  memory analysis; the alternating schedule runs both passes per half-slot on
  XLA:CPU), the predicted step and bubble. Profile `cpu`.
* **GPT-3 175B** (96 scanned layers, bf16, seq 2048, batch 1536, abstract arguments)
  on 1024 `a100-80g` devices (80 GB budget), model 8 inside a node, 4 and 8 stages, 48
  micro-batches, remat `"dots"` and none, the default engine: the predicted step,
  peak per device and bubble of each schedule, or that no plan fits.

    python -m benchmarks.schedules     # ~3 min; writes results/schedules.md (and .json)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import autopar  # noqa: E402
from autopar.errors import MemoryBudgetError  # noqa: E402
from autopar.examples.models import gpt  # noqa: E402
from autopar.plan.schedule import timeline  # noqa: E402
from benchmarks.pipeline import gpt3_step  # noqa: E402

OUT = Path(__file__).parent / "results" / "schedules"
SCHEDULES = ("gpipe", "1f1b", "1f1b-async", "zb-h1", "interleaved")


def _row(plan, seconds: float, **extra) -> dict:
    t = timeline(plan.pipeline)
    return {
        **extra,
        "schedule": plan.pipeline["schedule"],
        "held": [t.in_flight(s) for s in range(t.stages)],
        "step_ms": plan.cost.step_s * 1e3,
        "bubble": t.bubble,
        "peak_mb": plan.cost.peak_memory_bytes / 1e6,
        "above_args_mb": (plan.cost.peak_memory_bytes - plan.cost.argument_bytes) / 1e6,
        "plan_s": seconds,
    }


def compiled_rows() -> list[dict]:
    cfg = gpt.GPTConfig(
        hidden=64, heads=4, seq=64, vocab=256, layers=4, batch_size=32, scan_layers=True
    )
    ts, args = gpt.make_train_step(cfg), gpt.abstract_args(cfg)
    rows = []
    for stages in (4, 2):
        for schedule in SCHEDULES:
            if schedule == "interleaved" and cfg.layers % (2 * stages):
                continue  # 2 chunks of a stage's layers
            t0 = time.perf_counter()
            step = autopar.parallelize(
                ts.step,
                mesh={"stage": stages, "data": 8 // stages},
                cluster="cpu",
                pipeline_stages=stages,
                microbatches=4 * stages,  # micro-batches of 2 and 4 examples
                pipeline_schedule=schedule,
                progress=False,
            )
            plan = step.plan(*args)
            seconds = time.perf_counter() - t0
            temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
            rows.append(_row(plan, seconds, stages=stages, compiled_temp_mb=temp / 1e6))
    return rows


def gpt3_rows() -> list[dict]:
    ts, args = gpt3_step()
    rows = []
    for stages in (4, 8):
        for remat in ("dots", "none"):
            for schedule in SCHEDULES[1:]:
                t0 = time.perf_counter()
                try:
                    plan = autopar.parallelize(
                        ts.step,
                        mesh={"stage": stages, "data": 1024 // (8 * stages), "model": 8},
                        cluster="a100-80g",
                        pipeline_stages=stages,
                        microbatches=48,
                        pipeline_schedule=schedule,
                        remat=remat,
                        progress=False,
                    ).plan(*args)
                except MemoryBudgetError:
                    seconds = time.perf_counter() - t0
                    rows.append(dict(stages=stages, remat=remat, schedule=schedule, plan_s=seconds))
                    continue
                seconds = time.perf_counter() - t0
                rows.append(_row(plan, seconds, stages=stages, remat=plan.remat or "none"))
    return rows


def markdown(r: dict) -> str:
    out = [
        "# Pipeline schedules side by side",
        "",
        f"`python -m benchmarks.schedules`, {r['when']}; method: the module's docstring.",
        "",
        "## 4-layer GPT, 4 stages x data 2 (16 micro-batches) and 2 stages x data 4 (8), "
        "compiled on XLA:CPU",
        "",
        "| stages | schedule | held per stage | predicted step ms | bubble | predicted peak MB | "
        "of it above arguments MB | compiled temporaries MB | .plan() s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["compiled"]:
        out.append(
            f"| {x['stages']} | {x['schedule']} | {', '.join(map(str, x['held']))} | "
            f"{x['step_ms']:.2f} | "
            f"{x['bubble']:.0%} | {x['peak_mb']:.2f} | {x['above_args_mb']:.2f} | "
            f"{x['compiled_temp_mb']:.2f} | {x['plan_s']:.1f} |"
        )
    out += [
        "",
        "## GPT-3 175B, 1024 a100-80g (80 GB), model 8, 48 micro-batches",
        "",
        "| stages | remat | schedule | held by stage 0 | predicted step s | bubble | "
        "peak GB/device | .plan() s |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for x in r["gpt3"]:
        if "step_ms" not in x:
            out.append(
                f"| {x['stages']} | {x['remat']} | {x['schedule']} | no plan fits 80 GB "
                f"| | | | {x['plan_s']:.1f} |"
            )
            continue
        out.append(
            f"| {x['stages']} | {x['remat']} | {x['schedule']} | {x['held'][0]} | "
            f"{x['step_ms'] / 1e3:.2f} | {x['bubble']:.0%} | {x['peak_mb'] / 1e3:.1f} | "
            f"{x['plan_s']:.1f} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    r = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "compiled": compiled_rows(),
        "gpt3": gpt3_rows(),
    }
    OUT.with_suffix(".json").write_text(json.dumps(r, indent=1))
    OUT.with_suffix(".md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
