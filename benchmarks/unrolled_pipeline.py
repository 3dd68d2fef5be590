"""A pipeline over layers unrolled in Python against the same model under `scan`.

The same GPT-2-style AdamW step (`autopar.examples.gpt`), once with its blocks in a
Python loop (`h_<i>` parameters, as public Flax code writes them) and once under
`nn.scan` (stacked weights), planned with `pipeline_stages=2` (1F1B) on
`{"stage": 2, "data": 2, "model": 2}` in one process, side by side: `.plan()` wall
time, the predicted step and peak, the compiled program's per-device memory (XLA's
memory analysis), its collective-permutes, and the step measured on this machine's
simulated CPU devices (median of 5 after a warm-up; bf16 dots run in f32 on XLA:CPU, so
only the ratio between rows means anything). The unrolled model without a pipeline is
the reference a user has today.

    python -m benchmarks.unrolled_pipeline     # writes results/unrolled_pipeline.md
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

import autopar  # noqa: E402
from autopar import examples  # noqa: E402

OUT = Path(__file__).parent / "results" / "unrolled_pipeline"
MESH = {"stage": 2, "data": 2, "model": 2}
SHAPE = dict(hidden=256, layers=8, heads=8, seq=128, vocab=1024, batch=32)


def _concrete(args):
    """Position-dependent values for the abstract arguments (token ids in range)."""
    leaves, tree = jax.tree.flatten(args)
    out = []
    for i, x in enumerate(leaves):
        n = 1
        for d in x.shape:
            n *= d
        v = jax.numpy.arange(n).reshape(x.shape)
        if jax.numpy.issubdtype(x.dtype, jax.numpy.integer):
            v = v % SHAPE["vocab"]
        else:
            v = (jax.numpy.sin(v * 0.37 + i) * 0.02).astype(x.dtype)
        out.append(v)
    return jax.tree.unflatten(tree, out)


def measure(name: str, scan: bool, **options) -> dict:
    w = examples.gpt(**SHAPE, name=name, scan_layers=scan)
    if "pipeline_stages" in options:
        options["microbatches"] = 4
    par = autopar.parallelize(w.fn, mesh=MESH, cluster="h100-sxm", progress=False, **options)
    t = time.perf_counter()
    plan = par.plan(*w.args)
    plan_s = time.perf_counter() - t
    compiled = par.lower(*w.args).compile()
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    args = _concrete(w.args)
    state = par(*args)  # warm-up (places the leaves where the plan wants them)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        out = par(state[0], *args[1:])
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
        state = out
    return {
        "variant": name,
        "plan_s": round(plan_s, 2),
        "engine": plan.engine,
        "pipeline": bool(plan.pipeline),
        "rolled": bool(plan.pipeline and plan.pipeline.get("rolled")),
        "predicted_ms": round(plan.cost.step_s * 1e3, 4),
        "predicted_peak_mib": round(plan.cost.peak_memory_bytes / 2**20, 2),
        "compiled_mib": round(
            (
                mem.argument_size_in_bytes
                + mem.output_size_in_bytes
                + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes
            )
            / 2**20,
            2,
        ),  # fmt: skip
        "compiled_temp_mib": round(mem.temp_size_in_bytes / 2**20, 2),
        "collective_permutes": len(re.findall(r"collective-permute\(", hlo)),
        "cpu_step_ms": round(statistics.median(times) * 1e3, 1),
    }


def main() -> None:
    rows = [
        measure("scan, pipelined", True, pipeline_stages=2, pipeline_schedule="1f1b"),
        measure("unrolled, pipelined", False, pipeline_stages=2, pipeline_schedule="1f1b"),
        measure("unrolled, no pipeline", False),
    ]
    cols = list(rows[0])
    lines = [
        "# Pipelining layers unrolled in Python (benchmarks/unrolled_pipeline.py)",
        "",
        f"GPT {SHAPE}, AdamW, mesh {MESH}, h100-sxm profile, 4 micro-batches, one process.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows),
        "",
    ]
    OUT.parent.mkdir(exist_ok=True)
    OUT.with_suffix(".md").write_text("\n".join(lines))
    OUT.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
