"""Megatron-LM's GPT-3 175B configurations next to autopar's plan, on the captured step
and priced by one cost model: ``python -m benchmarks.megatron_175b``.

The GPT-3 175B train step (``benchmarks.pipeline.gpt3_step``: layers under ``nn.scan``,
bf16, seq 2048, batch 1536, AdamW, abstract arguments) on 1024 ``a100-80g`` devices:

* ``auto``: what a user gets, ``autopar.parallelize(mesh=1024, pipeline_stages="auto",
  remat="auto")`` with the default engine (``benchmarks.pipeline.parallelize_auto``);
  every row with the train state donated (``donate_argnums=0``, as a training loop
  passes it and as Megatron updates its weights in place: the updated state is written
  into its buffers; without it the state needs a second copy, which the predicted
  peak holds, and ``auto`` plans 32 stages at 27.94 s, ``benchmarks.unrolled_175b``);
* Megatron's configurations as ``parallelize`` calls that fix everything Megatron fixes:
  the mesh (``stage x data x model``), the stage count, micro-batch size 1 (M = batch /
  data), lock-step 1F1B, the remat policy, and Megatron's tensor-parallel layout of every
  parameter and moment pinned with ``in_specs=`` (``benchmarks.stage_model.megatron_specs``:
  q/k/v and c_fc column-split, o and c_proj row-split, the token embedding vocab-split,
  each layer on its stage). With ZeRO-1 (Megatron's distributed optimizer) the moments
  are pinned split over ``data`` as well. The search (``engine="dp"``) picks only what
  Megatron leaves open (the activations' layouts, the head) and runs with no memory
  budget, so the row is Megatron's layout even where it does not fit; the table says
  whether it fits 80 GB;
* Megatron's interleaved schedule (TP 8 x PP 8, v = 2 and 4 chunks per stage,
  selective recompute, ZeRO-1) twice: as autopar's ``pipeline_schedule="interleaved"``
  runs it (the lock-step interleaved 1F1B; the scanned weights moved into chunk order
  and the gradients back every step, priced), and as Megatron stores its weights, in
  chunk order: the same search with the moves priced at nothing
  (``search.piped._moved`` patched to move nothing, so neither their time nor their
  copies are counted and the search does not bend the layouts to make them cheap). A
  plan autopar prices but could not run.

And autopar by name on the same step with its 96 layers unrolled in Python (as public
Flax code writes them): ``parallelize(mesh={"stage": 8, "data": 16, "model": 8},
pipeline_stages=8, microbatches=96, remat="selective")`` with the default engine and
memory budget, donated, under lock-step 1F1B and under ``pipeline_schedule=
"interleaved", virtual_stages=4``, where the unrolled layers' leaves are kept in chunk
order as Megatron keeps its weights (nothing moves; ``autopar.ir.chunks``). Rows named
``autopar ...``; they are not Megatron's and not counted as its best.

Both under the profile as shipped and under the efficiency factors
``benchmarks.published`` fits to published step times (``compute+hbm``, read from
``results/published.json``). MFU: 6 N T model FLOPs over the A100's bf16 peak.

Writes ``results/megatron_175b.{json,md}``. About 18 minutes on 2 CPUs (the two ``auto``
searches take most of it, the unrolled rows about 3); ``--no-auto`` and ``--no-unrolled``
leave those out.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autopar  # noqa: E402
import cost_models  # noqa: E402
from autopar.ir.capture import path_str  # noqa: E402
from benchmarks import stage_model as SM  # noqa: E402
from benchmarks.pipeline import (  # noqa: E402
    DEVICES,
    GPT3,
    RESULTS,
    _fitted_profile,
    gpt3_step,
    parallelize_auto,
)

OUT = RESULTS / "megatron_175b"
TP = 8
# (name, pipeline stages, remat, ZeRO stage[, virtual stages]): Megatron-LM's 175B
# recipes on 1024 GPUs
CONFIGS = (
    ("TP 8 x PP 8, selective recompute", 8, "selective", 0),
    ("TP 8 x PP 8, selective recompute, ZeRO-1", 8, "selective", 1),
    ("TP 8 x PP 8, full recompute", 8, "full", 0),
    ("TP 8 x PP 8, full recompute, ZeRO-1", 8, "full", 1),
    ("TP 8 x PP 16, selective recompute", 16, "selective", 0),
    ("TP 8 x PP 16, selective recompute, ZeRO-1", 16, "selective", 1),
    ("TP 8 x PP 16, full recompute", 16, "full", 0),
    ("TP 8 x PP 16, full recompute, ZeRO-1", 16, "full", 1),
    ("TP 8 x PP 8, interleaved v=2, selective recompute, ZeRO-1", 8, "selective", 1, 2),
    ("TP 8 x PP 8, interleaved v=4, selective recompute, ZeRO-1", 8, "selective", 1, 4),
)
CHUNK_ORDER = " (weights stored in chunk order: no moves)"


def _zero1(spec: P, shape: tuple[int, ...], data: int) -> P:
    """`spec` with `data` added on the largest dim it leaves whole and `data` divides
    (Megatron's distributed optimizer shards each moment over the data-parallel group)."""
    dims = list(tuple(spec) + (None,) * (len(shape) - len(tuple(spec))))
    free = [d for d, a in enumerate(dims) if a is None and shape[d] % data == 0]
    if not free:
        return spec
    d = max(free, key=lambda d: shape[d])
    dims[d] = "data"
    return P(*dims)


def megatron_in_specs(args, stages: int, zero: int):
    """Megatron's layout of the scanned GPT-3 step's (state, batch): `megatron_specs`,
    each stacked layer parameter's leading (layer) dim on `stage`, and with `zero=1` the
    optimizer moments split over `data` too."""
    data = DEVICES // (stages * TP)
    mesh = {"stage": stages, "data": data, "model": TP}
    state_specs, batch_specs = SM.megatron_specs(args, mesh)

    def staged(path, spec, x):
        p = path_str(path)
        dims = tuple(spec) + (None,) * (len(x.shape) - len(tuple(spec)))
        if "/h/" in p and x.shape and x.shape[0] == GPT3.layers:  # the scanned stack
            dims = ("stage", *dims[1:])
        out = P(*dims) if x.shape else P()
        if zero and "opt_state" in p and x.shape:
            out = _zero1(out, x.shape, data)
        return out

    state_specs = jax.tree_util.tree_map_with_path(
        staged, state_specs, args[0], is_leaf=lambda s: isinstance(s, P)
    )
    return mesh, (state_specs, batch_specs)


def price_megatron(
    profile, stages: int, remat: str, zero: int, virtual: int = 1, chunk_order: bool = False
) -> dict:
    """One Megatron configuration planned and priced (the module docstring); with
    `chunk_order` the interleaved schedule's weight moves are priced at nothing."""
    import autopar.search.piped as piped

    ts, args = gpt3_step(True)
    mesh, specs = megatron_in_specs(args, stages, zero)
    data = mesh["data"]
    t = time.perf_counter()
    moved = piped._moved
    if chunk_order:
        piped._moved = lambda *a: ([], [])
    try:
        plan = _plan(ts, args, mesh, profile, stages, remat, specs, data, virtual)
    finally:
        piped._moved = moved
    return _summary(plan, profile, time.perf_counter() - t)


def _plan(ts, args, mesh, profile, stages, remat, specs, data, virtual):
    """A Megatron configuration: its layout pinned, the rest searched by `dp`, no budget."""
    return _planned(
        ts, args, mesh, profile, stages, data, virtual, remat,
        engine="dp", in_specs=specs, memory_budget=1e15,
    )  # fmt: skip


def _planned(ts, args, mesh, profile, stages, data, virtual, remat, **options):
    """`ts.step` planned on `mesh` with `stages` stages of `GPT3.batch // data`
    micro-batches under lock-step 1F1B, or interleaved at `virtual` > 1, the state
    donated (`options`: what else the call fixes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not compile-checked": no devices here
        return autopar.parallelize(
            ts.step,
            mesh=mesh,
            cluster=profile,
            pipeline_stages=stages,
            microbatches=GPT3.batch // data,
            pipeline_schedule="1f1b" if virtual == 1 else "interleaved",
            virtual_stages=virtual if virtual > 1 else None,
            remat=remat,
            donate_argnums=(0,),
            progress=False,
            cache_dir=False,
            **options,
        ).plan(*args)


def _summary(plan, profile, seconds: float) -> dict:
    prof = cost_models.load(profile)
    flops = SM.model_flops(GPT3.batch, GPT3.seq, GPT3.layers, GPT3.hidden, GPT3.vocab)
    peak = prof.flops_for(jnp.bfloat16)
    pipe = plan.pipeline or {}
    return {
        "engine": plan.engine,
        "mesh": plan.mesh.shape,
        "stages": pipe.get("stages"),
        "microbatches": pipe.get("microbatches"),
        "schedule": pipe.get("schedule"),
        "remat": plan.remat or "none",
        "step_s": plan.cost.step_s,
        "compute_s": plan.cost.compute_s,
        "comm_s": plan.cost.comm_s,
        "memory_gb": plan.cost.peak_memory_bytes / 1e9,
        "fits": plan.cost.peak_memory_bytes <= prof.hbm_bytes,
        "mfu": flops / (plan.cost.step_s * DEVICES * peak),
        "plan_s": seconds,
        **_moved(pipe),
    }


def _moved(pipe: dict) -> dict:
    """The interleaved schedule's moves into chunk order (seconds, GB), where recorded."""
    fused = [f for f in pipe.get("fused", ()) if "moved_seconds" in f]
    if not fused:
        return {}
    return {
        "moved_s": sum(f["moved_seconds"] for f in fused),
        "moved_gb": sum(f["moved_bytes"] for f in fused) / 1e9,
    }


BY_NAME = (
    ("autopar, unrolled layers, PP 8, 1F1B (by name)", 1),
    ("autopar, unrolled layers, PP 8, interleaved v=4 (by name)", 4),
)


def _by_name(profile, virtual: int) -> dict:
    """The unrolled step planned by name on Megatron's mesh (module docstring)."""
    ts, args = gpt3_step(False)
    mesh = {"stage": 8, "data": DEVICES // (8 * TP), "model": TP}
    t = time.perf_counter()
    plan = _planned(ts, args, mesh, profile, 8, mesh["data"], virtual, "selective")
    return _summary(plan, profile, time.perf_counter() - t)


def _auto(profile) -> dict:
    r = parallelize_auto(profile, remat="auto", engine="auto", scan_layers=True, donate=True)
    prof = cost_models.load(profile)
    p = r["pipeline"] or {}
    return {
        "engine": r["engine"],
        "mesh": r["mesh"],
        "stages": p.get("stages"),
        "microbatches": p.get("microbatches"),
        "schedule": p.get("schedule"),
        "remat": r["remat"],
        "step_s": r["step_s"],
        "compute_s": r["compute_s"],
        "comm_s": r["comm_s"],
        "memory_gb": r["memory_gb"],
        "fits": r["memory_gb"] * 1e9 <= prof.hbm_bytes,
        "mfu": r["mfu"],
        "plan_s": r["search_seconds"],
    }


def _row(name: str, r: dict) -> str:
    mesh = " x ".join(f"{a} {s}" for a, s in r["mesh"].items())
    fits = "yes" if r["fits"] else "**no**"
    return (
        f"| {name} | {mesh} | {r['microbatches']} | {r['schedule']} | {r['remat']} | "
        f"{r['engine']} | {r['step_s']:.2f} ({r['compute_s']:.2f} + {r['comm_s']:.2f}) | "
        f"{r['memory_gb']:.1f} ({fits}) | {100 * r['mfu']:.1f}% | {r['plan_s']:.0f} |"
    )


def _section(title: str, rows: dict) -> list[str]:
    out = [
        f"## {title}",
        "",
        "| plan | mesh | M | schedule | remat | engine | step s (compute + comm) | "
        "GB/device (fits 80 GB) | MFU | .plan() s |",
        "|---|---|---:|---|---|---|---|---|---:|---:|",
    ]
    out += [_row(n, r) for n, r in rows.items()]
    fitting = {n: r for n, r in rows.items() if not n.startswith(("auto", "autopar")) and r["fits"]}
    ours = [n for n in rows if n.startswith(("auto", "autopar")) and rows[n]["fits"]]
    if ours and fitting:
        best = min(fitting, key=lambda n: fitting[n]["step_s"])
        out += ["", f"The fastest Megatron configuration that fits 80 GB: {best}, "
                f"{fitting[best]['step_s']:.3f} s."]  # fmt: skip
        for n in ours:
            ratio = fitting[best]["step_s"] / rows[n]["step_s"]
            out.append(f"Against `{n}`'s {rows[n]['step_s']:.3f} s: Megatron / it = {ratio:.4f}.")
    return out + [""]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-auto", action="store_true", help="leave out the `auto` row")
    ap.add_argument(
        "--no-unrolled", action="store_true", help="leave out autopar's rows on the unrolled step"
    )
    ap.add_argument("--out", type=Path, default=OUT, help="results path, without suffix")
    ap.add_argument("--from-json", action="store_true", help="re-render the saved JSON")
    a = ap.parse_args(argv)
    if a.from_json:
        results = json.loads(a.out.with_suffix(".json").read_text())
        _write(a.out, results, [k for k in results if k != "efficiency_fitted"])
        return
    default = cost_models.load("a100-80g")
    fitted, eff = _fitted_profile(default)
    profiles = {"a100-80g as shipped": default}
    if fitted is not None:
        profiles["a100-80g, fitted (compute+hbm)"] = fitted
    results: dict = {"efficiency_fitted": eff}
    for title, prof in profiles.items():
        rows: dict = {}
        if not a.no_auto:
            rows["auto"] = _auto(prof)
            print(title, "auto", json.dumps(rows["auto"]), flush=True)
        for name, virtual in BY_NAME if not a.no_unrolled else ():
            rows[name] = _by_name(prof, virtual)
            print(title, name, json.dumps(rows[name]), flush=True)
        for name, stages, remat, zero, *virtual in CONFIGS:
            rows[name] = price_megatron(prof, stages, remat, zero, *virtual)
            print(title, name, json.dumps(rows[name]), flush=True)
            if virtual:
                rows[name + CHUNK_ORDER] = price_megatron(prof, stages, remat, zero, *virtual, True)
                print(title, name + CHUNK_ORDER, json.dumps(rows[name + CHUNK_ORDER]), flush=True)
        results[title] = rows
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    _write(a.out, results, list(profiles))


def _write(out: Path, results: dict, titles: list[str]) -> None:
    eff = results["efficiency_fitted"]
    lines = [
        "# GPT-3 175B: Megatron-LM's configurations and autopar's plan, one cost model",
        "",
        "`python -m benchmarks.megatron_175b` (what each row fixes: the module docstring). "
        "Captured step (layers under `nn.scan`; the `autopar ...` rows: unrolled in Python), "
        "1024 devices, abstract arguments; "
        f"machine: {os.cpu_count()} CPUs. Fitted factors: {eff}.",
        "",
    ]
    for title in titles:
        lines += _section(title, results[title])
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
