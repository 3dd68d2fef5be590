"""`remat=` on decoders whose layers are unrolled in Python, against the same GPT-2 with
its layers under `nn.scan`: compiled temporaries per device, as a user gets them.

Each model's AdamW train step is planned by `parallelize` with its defaults but the mesh
(`{"data": 2, "model": 2}`) and `remat`, lowered and compiled; the table gives XLA's
temporaries per device, the plan's predicted peak, and, for `remat="full"`, whether one
step (loss and every parameter) equals `jax.jit`'s (`nnx.jit`'s for the NNX model) on
position-dependent token ids. The models, as public code writes them: GPT-2 (fused qkv,
biases, tied embedding, `h_<i>` blocks in a `for` loop), the same under `nn.scan`,
Llama (RoPE, GQA, RMSNorm, SwiGLU, `layers_<i>`), and an NNX decoder keeping its blocks
in an `nnx.List` (`nnx.MultiHeadAttention` with a causal mask, an MLP).

XLA:CPU's default scheduler orders for concurrency and ignores memory, so there neither
`jax.checkpoint` nor autopar's remat lowers an unrolled step's temporaries; this script
runs XLA:CPU's memory-aware scheduler (`--xla_cpu_enable_concurrency_optimized_scheduler
=false`), which drops optimization barriers before it schedules: the plans there make
each layer's recomputation wait, by data, for the weight gradients of the layer above
(docs/features.md, "Layers unrolled in Python").

    python -m benchmarks.remat_unrolled     # ~3 min; writes results/remat_unrolled.md
"""

from __future__ import annotations

import os

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 "
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
)

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import autopar  # noqa: E402
from benchmarks.unrolled_pipeline import nnx_lm_step  # noqa: E402
from benchmarks.user_models_defs import gpt2, llama  # noqa: E402

OUT = Path(__file__).parent / "results" / "remat_unrolled"
MESH = {"data": 2, "model": 2}
SIZE = dict(vocab=512, d=128, heads=4, layers=8, seq=256, batch=8)
POLICIES = (None, "dots", "full")


class _NNXBlock(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class _NNXDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        d = SIZE["d"]
        self.embed = nnx.Embed(SIZE["vocab"], d, rngs=rngs)
        self.blocks = nnx.List([_NNXBlock(d, SIZE["heads"], rngs) for _ in range(SIZE["layers"])])
        self.head = nnx.Linear(d, SIZE["vocab"], rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _ids() -> jax.Array:
    n = SIZE["batch"] * (SIZE["seq"] + 1)
    return (jnp.arange(n) * 7 % SIZE["vocab"]).reshape(SIZE["batch"], -1)


def _close(a, b) -> bool:
    return all(
        np.allclose(x, y, rtol=2e-4, atol=2e-5)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _linen(name: str, case) -> list[dict]:
    params, opt_state, _ = case.make_args(jax.random.key(0))
    args = (params, opt_state, {"input_ids": _ids()})
    rows = []
    for remat in POLICIES:
        par = autopar.parallelize(case.step, mesh=MESH, remat=remat, progress=False)
        row = _row(name, remat, par, args)
        if remat == "full":
            got, want = par(*args), jax.jit(case.step)(*args)
            row["step equals jax.jit"] = _close(got, want)
        rows.append(row)
    return rows


def _nnx(name: str) -> list[dict]:
    rows = []
    for remat in POLICIES:
        models = [_NNXDecoder(nnx.Rngs(0)) for _ in range(2)]
        # eps 1e-6: the key projection's bias has a zero gradient in exact arithmetic
        # (softmax ignores a constant added to a query's scores), which Adam at eps 1e-8
        # turns from rounding noise into steps of the learning rate's size, either way
        tx = optax.adamw(3e-4, eps=1e-6)
        opts = [nnx.Optimizer(m, tx, wrt=nnx.Param) for m in models]
        par = autopar.parallelize(nnx_lm_step, mesh=MESH, remat=remat, progress=False)
        ids = _ids()[:, :-1]  # the step shifts them itself: seq tokens in, as the others
        row = _row(name, remat, par, (models[0], opts[0], ids))
        if remat == "full":
            losses = par(models[0], opts[0], ids), nnx.jit(nnx_lm_step)(models[1], opts[1], ids)
            row["step equals jax.jit"] = _close(losses[0], losses[1]) and _close(
                nnx.state(models[0]), nnx.state(models[1])
            )
        rows.append(row)
    return rows


def _row(name: str, remat, par, args) -> dict:
    t = time.perf_counter()
    plan = par.plan(*args)
    plan_s = time.perf_counter() - t
    temp = par.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return {
        "model": name,
        "remat": str(remat),
        "plan remat": str(plan.remat),
        "plan_s": round(plan_s, 1),
        "predicted_peak_mib": round(plan.cost.peak_memory_bytes / 2**20, 1),
        "compiled_temp_mib": round(temp / 2**20, 1),
    }


def main() -> None:
    rows = (
        _linen("GPT-2 under nn.scan", gpt2({**SIZE, "scan": True}))
        + _linen("GPT-2 unrolled", gpt2(SIZE))
        + _linen("Llama unrolled", llama({**SIZE, "kv_heads": 2, "ffn": 344}))
        + _nnx("NNX decoder (nnx.List of blocks)")
    )
    for r in rows:
        none = next(x for x in rows if x["model"] == r["model"] and x["remat"] == "None")
        r["less than none"] = (
            f"{none['compiled_temp_mib'] / max(r['compiled_temp_mib'], 1e-9):.1f}x"
        )
    cols = list(dict.fromkeys(c for r in rows for c in r))
    lines = [
        "# `remat=` on layers unrolled in Python (benchmarks/remat_unrolled.py)",
        "",
        f"Sizes {SIZE}, AdamW, mesh {MESH}, h100-sxm profile, XLA:CPU's memory-aware "
        "scheduler; compiled temporaries per device (XLA's memory analysis).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows),
        "",
    ]
    OUT.parent.mkdir(exist_ok=True)
    OUT.with_suffix(".md").write_text("\n".join(lines))
    OUT.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
