"""Plan files of the example models under many options, for checking that a refactor
leaves plans unchanged.

    python -m benchmarks.plan_files write DIR      # plans every case into DIR/<case>.json
    python -m benchmarks.plan_files compare A B    # byte-compare two such directories

`compare` reports each file as identical, identical but for op `source` lines (a moved
or re-wrapped line in the model's file shifts them), or different (exit status 1)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

CASES = [  # name, example, mesh, options
    ("gpt", "gpt_small", {"data": 2, "model": 4}, {}),
    ("mlp", "mlp_small", {"data": 4, "model": 2}, {}),
    ("cnn", "cnn_small", {"data": 8}, {}),
    ("emb", "embedding_small", {"data": 2, "model": 4}, {}),
    ("moe", "moe_small", {"data": 2, "model": 4}, {"cluster": "a100-80g"}),
    ("vit", "vit_small", {"data": 2, "model": 4}, {}),
    ("wrn", "wide_resnet_small", {"data": 4, "model": 2}, {}),
    ("gpt_dp", "gpt_small", {"data": 2, "model": 4}, {"engine": "dp"}),
    ("gpt_rec", "gpt_small", {"data": 2, "model": 4}, {"engine": "recursive"}),
    ("mlp_ilp", "mlp_small", {"data": 2, "model": 4}, {"engine": "ilp"}),
    ("gpt_fsdp", "gpt_small", {"data": 8}, {"engine": "fsdp"}),
    ("scan_pp", "gpt_scan_small", {"stage": 2, "data": 2, "model": 2}, {"pipeline_stages": 2}),
    (
        "scan_gpipe",
        "gpt_scan_small",
        {"stage": 2, "data": 2, "model": 2},
        {"pipeline_stages": 2, "pipeline_schedule": "gpipe", "microbatches": 4},
    ),
    ("scan_remat", "gpt_scan_small", {"data": 2, "model": 4}, {"remat": "full"}),
    ("gpt_bf16", "gpt_small", {"data": 2, "model": 4}, {"precision": "bf16"}),
    ("gpt_acc", "gpt_small", {"data": 2, "model": 4}, {"grad_accumulation": 2}),
    ("gpt_auto_mesh", "gpt_small", 8, {}),
]


def write(out: Path) -> None:
    import autopar
    from autopar import examples

    out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")
    for name, example, mesh, options in CASES:
        w = getattr(examples, example)()
        step = autopar.parallelize(w.fn, mesh=mesh, donate_argnums=w.donate_argnums, **options)
        step.plan(*w.args).save(out / f"{name}.json")
        print(name, flush=True)


def _without_sources(x):
    if isinstance(x, dict):
        return {k: _without_sources(v) for k, v in x.items() if k != "source"}
    if isinstance(x, list):
        return [_without_sources(v) for v in x]
    return x


def compare(a: Path, b: Path) -> bool:
    same = True
    for f in sorted({p.name for p in a.glob("*.json")} | {p.name for p in b.glob("*.json")}):
        if not (a / f).exists() or not (b / f).exists():
            print(f"{f}: only in one directory")
            same = False
        elif (a / f).read_bytes() == (b / f).read_bytes():
            print(f"{f}: identical")
        elif _without_sources(json.loads((a / f).read_text())) == _without_sources(
            json.loads((b / f).read_text())
        ):
            print(f"{f}: identical but for op source lines")
        else:
            print(f"{f}: DIFFERENT")
            same = False
    return same


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(0 if compare(Path(sys.argv[2]), Path(sys.argv[3])) else 1)
    else:
        sys.exit(__doc__)
