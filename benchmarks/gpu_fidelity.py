"""The cost model's compute prices against one real GPU: ``python -m benchmarks.gpu_fidelity``.

Two parts, each run where it can be:

* ``--predict`` (here, any machine): autopar's predicted step (``parallelize(...).plan``
  on one device, ``cluster="h200-sxm"``) for each model below, written to
  ``results/gpu_fidelity_predicted.json``. One device: no communication, so the
  prediction is the cost model's compute and memory pricing alone.
* ``--measure`` (on the GPU; ``--out DIR``): the matrix-product rates JAX gets at each
  dtype and matmul precision (an 8192-cubed product, the mean of 10 after 3 warm-ups),
  and each model's training step as plain ``jax.jit`` runs it, timed the same way,
  next to the prediction read from the JSON above. The ratio predicted / measured says
  how far the profile's efficiency factors (compute 0.6, HBM 0.8) are from this GPU
  for these steps.

The models: the example GPT (``autopar.examples.gpt``, AdamW, layers under ``nn.scan``)
at GPT-2-medium width (hidden 1024, 16 heads, 24 layers, seq 1024, vocab 32768,
batch 8) in float32 (JAX's default matmul precision: TF32 on Hopper) and in bfloat16,
and a smaller one (hidden 512, 8 layers, seq 512, batch 16) in float32. For the two
medium ones also parts of the step on their own: the loss (forward), the loss and its
gradient, and AdamW's update (a memory-bound pass over the parameters and moments), to
place the gap.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

RESULTS = Path(__file__).parent / "results"
PREDICTED = RESULTS / "gpu_fidelity_predicted.json"
MODELS = {  # name: GPTConfig keywords
    "gpt-medium-f32": dict(
        hidden=1024, heads=16, layers=24, seq=1024, vocab=32768, batch_size=8, dtype="float32"
    ),
    "gpt-medium-bf16": dict(
        hidden=1024, heads=16, layers=24, seq=1024, vocab=32768, batch_size=8, dtype="bfloat16"
    ),
    "gpt-small-f32": dict(
        hidden=512, heads=8, layers=8, seq=512, vocab=32768, batch_size=16, dtype="float32"
    ),
}


def _config(kw: dict):
    from autopar.examples.models import gpt

    kw = dict(kw)
    kw["dtype"] = getattr(jnp, kw["dtype"])
    return gpt, gpt.GPTConfig(**kw, scan_layers=True)


PHASES = ("gpt-medium-f32", "gpt-medium-bf16")


def phases(ts) -> dict:
    """Parts of the step as functions of (state, batch): the loss, the loss and its
    gradient, and AdamW's update from a gradient (the state's parameters stand in)."""
    from autopar.examples.models.common import make_optimizer

    tx = make_optimizer(1e-2)

    def grad(state, batch):
        return jax.value_and_grad(lambda p: ts.loss({"params": p}, batch))(state["params"])

    def update(state, batch):
        params = state["params"]
        updates, opt_state = tx.update(params, state["opt_state"], params)
        return optax.apply_updates(params, updates), opt_state

    def loss(state, batch):
        return ts.loss({"params": state["params"]}, batch)

    return {"loss": loss, "grad": grad, "update": update}


def predict() -> dict:
    import autopar

    def priced(fn, args) -> dict:
        plan = autopar.parallelize(
            fn, mesh={"data": 1}, cluster="h200-sxm", progress=False, cache_dir=False
        ).plan(*args)
        return {
            "step_s": plan.cost.step_s,
            "compute_s": plan.cost.compute_s,
            "peak_memory_bytes": plan.cost.peak_memory_bytes,
            "engine": plan.engine,
        }

    out = {}
    for name, kw in MODELS.items():
        gpt, cfg = _config(kw)
        ts, args = gpt.make_train_step(cfg), gpt.abstract_args(cfg)
        out[name] = priced(ts.step, args)
        if name in PHASES:
            out[name]["phases"] = {k: priced(f, args) for k, f in phases(ts).items()}
        print(name, out[name], flush=True)
    return out


def _time(fn, *args, n: int = 10, warm: int = 3) -> float:
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def matmul_rates(n: int = 8192) -> dict:
    out = {}
    key = jax.random.PRNGKey(0)
    for label, dtype, precision in (
        ("bfloat16", jnp.bfloat16, None),
        ("float32 default precision", jnp.float32, None),
        ("float32 precision=highest", jnp.float32, jax.lax.Precision.HIGHEST),
    ):
        a = jax.random.normal(key, (n, n), dtype)
        b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype)
        f = jax.jit(lambda a, b, p=precision: jnp.matmul(a, b, precision=p))
        s = _time(f, a, b)
        out[label] = {"seconds": s, "tflops": 2 * n**3 / s / 1e12}
        print(label, out[label], flush=True)
    return out


def measure(out_dir: Path) -> dict:
    result = {
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "matmul": matmul_rates(),
    }
    predicted = json.loads(PREDICTED.read_text())
    steps = {}
    for name, kw in MODELS.items():
        try:
            gpt, cfg = _config(kw)
            ts = gpt.make_train_step(cfg)
            state = jax.jit(ts.init)(0)
            batch = ts.batch(0)
            step = jax.jit(ts.step, donate_argnums=0)
            ma = step.lower(state, batch).compile().memory_analysis()
            compiled = ma.argument_size_in_bytes + ma.output_size_in_bytes
            compiled += ma.temp_size_in_bytes - ma.alias_size_in_bytes

            def run(state, batch, step=step):
                return step(state, batch)[0]

            for _ in range(3):
                state = run(state, batch)
            jax.block_until_ready(state)
            t = time.perf_counter()
            for _ in range(10):
                state = run(state, batch)
            jax.block_until_ready(state)
            seconds = (time.perf_counter() - t) / 10
            p = predicted[name]
            halves = {}
            for k, f in phases(ts).items() if name in PHASES else ():
                measured = _time(jax.jit(f), state, batch)
                halves[k] = {
                    "measured_s": measured,
                    "predicted_s": p["phases"][k]["step_s"],
                    "predicted_over_measured": p["phases"][k]["step_s"] / measured,
                }
            steps[name] = {
                "phases": halves,
                "measured_s": seconds,
                "predicted_s": p["step_s"],
                "predicted_over_measured": p["step_s"] / seconds,
                "compiled_bytes": compiled,  # arguments + outputs + temporaries - aliased
                "predicted_peak_bytes": p["peak_memory_bytes"],
            }
        except Exception as e:  # report and go on: one model must not lose the others
            steps[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(name, steps[name], flush=True)
        result["steps"] = steps
        (out_dir / "gpu_fidelity.json").write_text(json.dumps(result, indent=1))
    result["autopar_on_gpu"] = _autopar_step("gpt-small-f32")
    print("autopar", result["autopar_on_gpu"], flush=True)
    (out_dir / "gpu_fidelity.json").write_text(json.dumps(result, indent=1))
    return result


def _autopar_step(name: str) -> dict:
    """The same step through `autopar.parallelize` on this one GPU (its lowering on a GPU
    backend): its time next to `jax.jit`'s, and its loss after 3 steps next to jit's."""
    try:
        import autopar

        gpt, cfg = _config(MODELS[name])
        ts = gpt.make_train_step(cfg)
        out = {}
        for label, fn in (
            ("jax.jit", jax.jit(ts.step)),
            ("autopar", autopar.parallelize(ts.step, mesh={"data": 1}, cluster="h200-sxm")),
        ):
            state, losses = jax.jit(ts.init)(0), []
            for i in range(3):
                state, metrics = fn(state, ts.batch(i))
                losses.append(float(metrics["loss"]))
            batch = ts.batch(0)
            seconds = _time(lambda s, b, fn=fn: fn(s, b)[0], state, batch)
            out[label] = {"losses": losses, "seconds": seconds}
        return out
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:800]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--predict", action="store_true", help="write the predictions (any machine)")
    ap.add_argument("--measure", action="store_true", help="time the steps (on the GPU)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where --measure writes")
    a = ap.parse_args(argv)
    if a.predict:
        RESULTS.mkdir(parents=True, exist_ok=True)
        PREDICTED.write_text(json.dumps(predict(), indent=1) + "\n")
    if a.measure:
        a.out.mkdir(parents=True, exist_ok=True)
        measure(a.out)


if __name__ == "__main__":
    main()
