"""Planning time against tracing: `.plan()` wall time (capture included) next to a
`jax.make_jaxpr` trace of the same function in the same process (trace first, the
median of three; each from cleared JAX trace caches, as `.plan()` is), the seconds of
each phase as the plan records them, and `.plan()` again from the plan cache in the
same process (a new `parallelize`, so only the disk cache can answer).

    python -m benchmarks.plan_time            # the suite's small models, engine auto
    python -m benchmarks.plan_time --large    # also GPT-3 175B (96 unrolled layers,
                                              # recursive, {"data": 128, "model": 8})
                                              # and a 7B Llama-style step (32 unrolled
                                              # layers, auto, {"data": 32, "model": 8},
                                              # and mesh=256: mesh-shape search)

Writes benchmarks/results/plan_time.md (and .json)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

SMALL = [  # example, mesh, options
    ("gpt_small", {"data": 2, "model": 4}, {}),
    ("mlp_small", {"data": 4, "model": 2}, {}),
    ("cnn_small", {"data": 8}, {}),
    ("moe_small", {"data": 2, "model": 4}, {"cluster": "a100-80g"}),
    ("vit_small", {"data": 2, "model": 4}, {}),
    ("wide_resnet_small", {"data": 4, "model": 2}, {}),
]
LARGE_MESH = {"data": 128, "model": 8}
TRACES = 3  # cold traces per model; the ratio divides by their median
OUT = Path(__file__).parent / "results" / "plan_time"


def llama_7b(layers: int = 32, batch: int = 8, seq: int = 2048):
    """A Llama-style training step (RMSNorm, rotary attention, SwiGLU; hidden 4096,
    32 heads, MLP 11008, vocab 32000, bfloat16; layers unrolled) with abstract
    arguments: (fn, args)."""
    d, heads, ff, vocab = 4096, 32, 11008, 32000
    dt = jnp.bfloat16
    hd = d // heads

    def rms(x, w):
        return (
            x
            * jax.lax.rsqrt(jnp.mean(x.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-6).astype(
                dt
            )
            * w
        )

    def rotary(x):
        pos = jnp.arange(seq, dtype=jnp.float32)[:, None]
        freq = 1.0 / (10000 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
        ang = pos * freq
        cos, sin = jnp.cos(ang).astype(dt), jnp.sin(ang).astype(dt)
        x1, x2 = x[..., ::2], x[..., 1::2]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)

    def layer(x, p):
        h = rms(x, p["ln1"])
        q = rotary((h @ p["wq"]).reshape(batch, seq, heads, hd))
        k = rotary((h @ p["wk"]).reshape(batch, seq, heads, hd))
        v = (h @ p["wv"]).reshape(batch, seq, heads, hd)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(dt)
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        att = jax.nn.softmax(jnp.where(mask, att, -1e4).astype(jnp.float32), -1).astype(dt)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(batch, seq, d)
        x = x + o @ p["wo"]
        h = rms(x, p["ln2"])
        return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]

    def loss(params, tokens):
        x = params["embed"][tokens[:, :-1]]
        for p in params["layers"]:
            x = layer(x, p)
        logits = (rms(x, params["ln_f"]) @ params["head"]).astype(jnp.float32)
        labels = jax.nn.one_hot(tokens[:, 1:], vocab)
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))

    def step(params, tokens):
        grads = jax.grad(loss)(params, tokens)
        return jax.tree_util.tree_map(lambda w, g: w - (1e-4 * g).astype(w.dtype), params, grads)

    S = lambda *shape: jax.ShapeDtypeStruct(shape, dt)
    block = {
        "ln1": S(d), "wq": S(d, d), "wk": S(d, d), "wv": S(d, d), "wo": S(d, d),
        "ln2": S(d), "w1": S(d, ff), "w3": S(d, ff), "w2": S(ff, d),
    }  # fmt: skip
    params = {"embed": S(vocab, d), "layers": [block] * layers, "ln_f": S(d), "head": S(d, vocab)}
    return step, (params, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32))


def measure(name: str, fn, args, mesh, donate=(), **options) -> dict:
    import autopar

    # JAX caches the traces of the jitted functions a step calls (jnp's, flax's): building
    # the example (its `init`) warms some, a trace warms the rest. Each trace and `.plan()`
    # (whose capture traces the step) start from cleared caches, so neither is timed
    # warmer than the other. The trace is the median of three: one trace of the same
    # step varied 1.0-1.9 s between runs on this machine, the ratio's whole spread.
    traces = []
    for _ in range(TRACES):
        jax.clear_caches()
        t = time.perf_counter()
        jaxpr = jax.make_jaxpr(fn)(*args)
        traces.append(time.perf_counter() - t)
    trace = statistics.median(traces)
    jax.clear_caches()
    common = dict(mesh=mesh, donate_argnums=donate, progress=False, **options)
    with tempfile.TemporaryDirectory() as cache, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        plan = autopar.parallelize(fn, cache_dir=cache, **common).plan(*args)
        planned = time.perf_counter() - t
        t = time.perf_counter()
        hit = autopar.parallelize(fn, cache_dir=cache, **common).plan(*args)
        cached = time.perf_counter() - t
    assert hit.cache and hit.cache["status"] == "hit", hit.cache
    row = {
        "model": name,
        "ops": len(jaxpr.eqns),
        "mesh": dict(plan.mesh.shape),  # the plan's; `mesh=N` searched N devices' shapes
        **({"mesh_search": mesh} if isinstance(mesh, int) else {}),
        "step_ms": round(plan.cost.step_s * 1e3, 4),
        "engine": plan.engine,
        "trace_s": round(trace, 3),
        "traces_s": [round(x, 3) for x in traces],
        "plan_s": round(planned, 3),
        "ratio": round(planned / trace, 1),
        "cached_plan_s": round(cached, 3),
        "phases": plan.phases,
        "worker_phases": plan.worker_phases,  # the searches side by side: their own seconds
        "cached_phases": hit.phases,
    }
    print(json.dumps(row), flush=True)
    return row


def _table(rows: list[dict]) -> str:
    lines = [
        "| model | jaxpr eqns | mesh | engine | make_jaxpr s (median of 3) | .plan() s | ratio | cached .plan() s | largest phases |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        top = sorted(
            ((k, v) for k, v in r["phases"].items() if k != "total"), key=lambda kv: -kv[1]
        )[:4]
        mesh = "x".join(f"{a}{s}" for a, s in r["mesh"].items())
        if "mesh_search" in r:
            mesh = f"{r['mesh_search']} devices: {mesh}"
        lines.append(
            f"| {r['model']} | {r['ops']} | {mesh} | {r['engine']} | {r['trace_s']:.2f} | "
            f"{r['plan_s']:.2f} | {r['ratio']:.1f}x | {r['cached_plan_s']:.2f} | "
            + ", ".join(f"{k} {v:.2f}" for k, v in top)
            + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", action="store_true", help="also GPT-3 175B and a 7B Llama step")
    ap.add_argument(
        "--only",
        nargs="*",
        help="run only these models (gpt3_175b, llama_7b, llama_7b_mesh256 too)",
    )
    ap.add_argument("--out", type=Path, default=OUT, help="results path, without suffix")
    a = ap.parse_args(argv)
    want = lambda name: not a.only or name in a.only
    from autopar import examples
    from autopar.search import workers

    rows = []
    for name, mesh, options in SMALL:
        if not want(name):
            continue
        w = getattr(examples, name)()
        rows.append(measure(name, w.fn, w.args, mesh, w.donate_argnums, engine="auto", **options))
    if a.large:
        if want("gpt3_175b"):
            w = examples.gpt3_175b()
            rows.append(
                measure(
                    "gpt3_175b",
                    w.fn,
                    w.args,
                    LARGE_MESH,
                    w.donate_argnums,
                    engine="recursive",
                    memory_budget=1e15,  # priced even where it would not fit (benchmarks.run)
                )
            )
        if want("llama_7b"):
            fn, args = llama_7b()
            rows.append(
                measure(
                    "llama_7b",
                    fn,
                    args,
                    {"data": 32, "model": 8},
                    engine="auto",
                    memory_budget=1e15,
                )
            )
        if want("llama_7b_mesh256"):  # mesh-shape search: 12 shapes of 256 devices
            fn, args = llama_7b()
            rows.append(
                measure("llama_7b_mesh256", fn, args, 256, engine="auto", memory_budget=1e15)
            )
    cpu = os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = (
        "# Planning time against tracing\n\n"
        "`python -m benchmarks.plan_time" + (" --large" if a.large else "") + "`: `.plan()` wall "
        "time (capture included, plan cache off) next to a `jax.make_jaxpr` trace of the same "
        "function in the same process (traced first, the median of three traces; JAX's trace "
        "caches cleared before each trace and before `.plan()`, so all start cold), and "
        "`.plan()` again from the plan "
        "cache (a new `parallelize`, same process). Phases as `Plan.phases` records them.\n\n"
        f"Machine: {cpu} CPUs, load average {load:.1f} when it finished "
        f"(JAX {jax.__version__}); search workers: {workers.count()} "
        "(`AUTOPAR_WORKERS`; `auto`'s engines and the mesh screen run side by side on "
        "problems of 1000+ nodes, their wall time is the phase `engines` / `screen`).\n\n"
        + _table(rows)
        + "\n"
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text(text)
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
