"""GPT-3 175B with its 96 layers unrolled in Python against the same model under `scan`.

The captured GPT-3 175B train step (`autopar.examples.models.gpt`, bf16, seq 2048,
batch 1536, AdamW, abstract arguments) planned with what a user writes:
`autopar.parallelize(fn, mesh=1024, cluster="a100-80g", pipeline_stages="auto",
remat="auto")`, the engine left at its default (`auto`), once with the layers under
`nn.scan` and once unrolled (`h_0 .. h_95`, as public Flax code writes them), in one
process, scanned model first: `.plan()` wall time (capture included), the plan's
pipeline, remat, predicted step, MFU (6 N T FLOPs over the a100-80g bf16 peak) and
predicted peak per device.

    python -m benchmarks.unrolled_175b     # writes results/unrolled_175b.md (and .json)
    python -m benchmarks.unrolled_175b --scan-only   # the scanned row alone
    python -m benchmarks.unrolled_175b --donate      # and each with its state donated
    python -m benchmarks.unrolled_175b --fitted      # under the efficiency factors
                                                     # `benchmarks.published` fits
(each row 1.5-2.5 minutes on 2 CPUs).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import cost_models  # noqa: E402
from autopar.search import workers  # noqa: E402
from benchmarks.pipeline import _fitted_profile, parallelize_auto  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "unrolled_175b"


def _row(name: str, r: dict) -> str:
    p = r["pipeline"]
    pipe = f"S={p.get('stages')}, M={p.get('microbatches')}, {p.get('schedule')}" if p else "none"
    mesh = "x".join(f"{a}{s}" for a, s in r["mesh"].items())
    return (
        f"| {name} | {r['search_seconds']:.0f} | {r['engine']} | {mesh} | {pipe} | "
        f"{r['remat']} | {r['step_s']:.2f} | {100 * r['mfu']:.1f}% | {r['memory_gb']:.1f} |"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a100-80g")
    ap.add_argument(
        "--fitted",
        action="store_true",
        help="the profile under the factors benchmarks.published fits (results/published.json)",
    )
    ap.add_argument("--out", type=Path, default=OUT, help="results path, without suffix")
    ap.add_argument("--scan-only", action="store_true", help="plan the scanned model only")
    ap.add_argument(
        "--donate",
        action="store_true",
        help="also each model with its state donated (the scanned one alone with --scan-only)",
    )
    a = ap.parse_args(argv)
    rows = {}
    models = (
        [("scan", True, False)]
        if a.scan_only
        else [("scan", True, False), ("unrolled", False, False)]
    )
    if a.donate:
        models.append(("nn.scan, state donated", True, True))
        if not a.scan_only:
            models.append(("unrolled, state donated", False, True))
    profile, factors = a.profile, None
    if a.fitted:
        profile, factors = _fitted_profile(cost_models.load(a.profile))
        if profile is None:
            raise SystemExit("--fitted: no results/published.json (python -m benchmarks.published)")
    for name, scan, donate in models:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows[name] = parallelize_auto(
                profile, remat="auto", engine="auto", scan_layers=scan, donate=donate
            )
        print(name, json.dumps(rows[name]), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)  # kept row by row: a long run
        a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    s, u = rows["scan"], rows.get("unrolled")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = "\n".join(
        [
            "# GPT-3 175B: layers unrolled in Python against `nn.scan`",
            "",
            "`python -m benchmarks.unrolled_175b`: `parallelize(mesh=1024, "
            f'cluster="{a.profile}"{" with the fitted factors " + str(factors) if a.fitted else ""}, '
            'pipeline_stages="auto", remat="auto")` with the '
            "default engine, abstract arguments, one process, scanned model first. "
            f"Machine: {os.cpu_count()} CPUs, load average {load:.1f} at the end; "
            f"search workers: {workers.count()} (`AUTOPAR_WORKERS`).",
            "",
            "| model | .plan() s | engine | mesh | pipeline | remat | predicted step s | "
            "MFU | peak GB/device |",
            "|---|---|---|---|---|---|---|---|---|",
            _row("nn.scan", s),
            *([_row("unrolled", u)] if u else []),
            *([_row(k, rows[k]) for k in rows if "donated" in k]),
            "",
            "Nothing is donated but in the rows that say so (`donate_argnums=0`, the train "
            "state, as a training loop passes it): without it the updated state needs "
            "buffers of its own beside the arguments, which the predicted peak holds.",
            "",
            f"Unrolled / scanned: `.plan()` {u['search_seconds'] / s['search_seconds']:.2f}x, "
            f"MFU {u['mfu'] / s['mfu']:.3f}x."
            if u
            else "(`--scan-only`: the unrolled model was not planned.)",
            "",
        ]
    )
    a.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"(run: {time.perf_counter() - t0:.0f} s)")
