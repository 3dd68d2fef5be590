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

A second table: an NNX decoder whose blocks hold `nnx.Dropout` (each layer's rng count
is a result of the step, made layer by layer), pipelined on the same mesh with 8
micro-batches: the default schedule (1F1B, which folds the counts over the
micro-batches) against GPipe (what the default gave way to before): predicted peak and
compiled temporaries, the counts checked against `nnx.jit`'s after one step.

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
import optax  # noqa: E402
from flax import nnx  # noqa: E402

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


class _Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.down(nnx.gelu(self.up(self.norm(x)))))


class _NNXDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        d, v = SHAPE["hidden"], SHAPE["vocab"]
        self.embed = nnx.Embed(v, d, rngs=rngs)
        self.blocks = nnx.List([_Block(d, rngs) for _ in range(SHAPE["layers"])])
        self.head = nnx.Linear(d, v, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def nnx_lm_step(model, opt, ids):
    """An NNX next-token train step, as NNX examples write one."""

    def loss_fn(m):
        logits = m(ids)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


def measure_nnx(schedule: str | None) -> dict:
    """The NNX dropout decoder pipelined (module doc), one step run and checked."""
    make = lambda: _NNXDecoder(nnx.Rngs(0, dropout=1))  # noqa: E731
    model, ref = make(), make()
    opts = [nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param) for m in (model, ref)]
    ids = (jax.numpy.arange(SHAPE["batch"] * SHAPE["seq"]) * 7 % SHAPE["vocab"]).reshape(
        SHAPE["batch"], SHAPE["seq"]
    )
    par = autopar.parallelize(
        nnx_lm_step, mesh=MESH, progress=False, pipeline_stages=2, microbatches=8,
        pipeline_schedule=schedule,
    )  # fmt: skip
    t = time.perf_counter()
    plan = par.plan(model, opts[0], ids)
    plan_s = time.perf_counter() - t
    mem = par.lower(model, opts[0], ids).compile().memory_analysis()
    par(model, opts[0], ids)
    nnx.jit(nnx_lm_step)(ref, opts[1], ids)
    counts = [int(b.drop.rngs.count[...]) for b in model.blocks]
    return {
        "variant": f"NNX + dropout, pipeline_schedule={schedule!r}",
        "schedule": plan.pipeline["schedule"],
        "plan_s": round(plan_s, 2),
        "predicted_ms": round(plan.cost.step_s * 1e3, 4),
        "predicted_peak_mib": round(plan.cost.peak_memory_bytes / 2**20, 2),
        "compiled_temp_mib": round(mem.temp_size_in_bytes / 2**20, 2),
        "rng_counts_as_nnx_jit": counts == [int(b.drop.rngs.count[...]) for b in ref.blocks],
    }


def _table(rows: list[dict]) -> list[str]:
    cols = list(rows[0])
    return [
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows),
    ]


def main() -> None:
    rows = [
        measure("scan, pipelined", True, pipeline_stages=2, pipeline_schedule="1f1b"),
        measure("unrolled, pipelined", False, pipeline_stages=2, pipeline_schedule="1f1b"),
        measure("unrolled, no pipeline", False),
    ]
    nnx_rows = [measure_nnx(None), measure_nnx("gpipe")]
    lines = [
        "# Pipelining layers unrolled in Python (benchmarks/unrolled_pipeline.py)",
        "",
        f"GPT {SHAPE}, AdamW, mesh {MESH}, h100-sxm profile, 4 micro-batches, one process.",
        "",
        *_table(rows),
        "",
        f"NNX decoder of {SHAPE['layers']} MLP blocks with `nnx.Dropout` (hidden "
        f"{SHAPE['hidden']}, seq {SHAPE['seq']}, batch {SHAPE['batch']}), AdamW, mesh {MESH}, "
        "8 micro-batches: the default schedule against GPipe.",
        "",
        *_table(nnx_rows),
        "",
    ]
    OUT.parent.mkdir(exist_ok=True)
    OUT.with_suffix(".md").write_text("\n".join(lines))
    OUT.with_suffix(".json").write_text(
        json.dumps({"gpt": rows, "nnx_dropout": nnx_rows}, indent=1)
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
