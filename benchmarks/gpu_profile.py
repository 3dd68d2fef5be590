"""Where a training step's time goes on one GPU, kernel by kernel:
``python -m benchmarks.gpu_profile --trace DIR`` on the GPU, ``--summarize DIR`` anywhere.

Traces the example GPT at GPT-2-medium width (``benchmarks.gpu_fidelity``'s
``gpt-medium-bf16`` and ``-f32``; with ``--unrolled`` the bf16 one under ``nn.scan``
and with its layers unrolled in Python) with ``jax.profiler`` (a Perfetto trace), three steps
after three warm-ups, and sums the GPU kernels' time by kind: matrix products (cuBLAS /
cuBLASLt / CUTLASS ``gemm`` kernels), XLA's fused elementwise and reduction kernels,
copies and the rest. Used to place the gap between autopar's predicted step and the
measured one (``benchmarks/discussion.md``, session 31).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

KINDS = (  # (kind, substrings of a kernel's name), first match wins
    ("matmul", ("gemm", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "nvjet")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset")),
    ("fusion", ("fusion", "loop_", "input_", "reduce", "triton")),
)


def trace(out: Path, unrolled: bool = False) -> None:
    """Trace both models (`unrolled`: the bf16 one with its layers unrolled in Python
    too, to see which kernels the scan's loop adds)."""
    import dataclasses

    import jax

    from benchmarks.gpu_fidelity import MODELS, _config

    runs = [("gpt-medium-bf16", True), ("gpt-medium-f32", True)]
    if unrolled:
        runs = [("gpt-medium-bf16", True), ("gpt-medium-bf16", False)]
    for name, scanned in runs:
        gpt, cfg = _config(MODELS[name])
        cfg = dataclasses.replace(cfg, scan_layers=scanned)
        name = name if scanned else name + "-unrolled"
        ts = gpt.make_train_step(cfg)
        state, batch = jax.jit(ts.init)(0), ts.batch(0)
        step = jax.jit(ts.step, donate_argnums=0)
        for _ in range(3):
            state = step(state, batch)[0]
        jax.block_until_ready(state)
        t = time.perf_counter()
        for _ in range(5):
            state = step(state, batch)[0]
        jax.block_until_ready(state)
        print(name, "ms per step", (time.perf_counter() - t) / 5 * 1e3, flush=True)
        where = Path("/tmp/prof") / name
        with jax.profiler.trace(str(where), create_perfetto_trace=True):
            for _ in range(3):
                state = step(state, batch)[0]
            jax.block_until_ready(state)
        found = sorted(where.rglob("perfetto_trace.json.gz"))
        if found:
            shutil.copy(found[-1], out / f"{name}.trace.json.gz")
        del state


def summarize(out: Path) -> dict:
    result = {}
    for path in sorted(out.glob("*.trace.json.gz")):
        with gzip.open(path) as f:
            events = json.load(f)
        events = events["traceEvents"] if isinstance(events, dict) else events
        names = {}
        for e in events:  # thread names: the GPU streams' events are the kernels
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                names[(e.get("pid"), e.get("tid"))] = e["args"]["name"]
        by_kind: dict[str, float] = defaultdict(float)
        top: dict[str, float] = defaultdict(float)
        for e in events:
            if e.get("ph") != "X":
                continue
            thread = names.get((e.get("pid"), e.get("tid")), "")
            if "stream" not in thread.lower():
                continue
            n = e.get("name", "").lower()
            kind = next((k for k, subs in KINDS if any(s in n for s in subs)), "other")
            by_kind[kind] += e.get("dur", 0) / 3e3  # us over 3 steps -> ms per step
            top[e.get("name", "")[:80]] += e.get("dur", 0) / 3e3
        result[path.name.split(".")[0]] = {
            "ms_per_step_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:15]),
        }
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="trace on this machine's GPU into DIR")
    ap.add_argument("--summarize", type=Path, help="sum the traces in DIR by kernel kind")
    ap.add_argument("--unrolled", action="store_true", help="bf16, scanned and unrolled")
    a = ap.parse_args(argv)
    if a.trace:
        a.trace.mkdir(parents=True, exist_ok=True)
        trace(a.trace, a.unrolled)
    if a.summarize:
        print(json.dumps(summarize(a.summarize), indent=1))


if __name__ == "__main__":
    main()
