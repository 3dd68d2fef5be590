"""One process of the multi-process test (tests/test_multihost.py starts two).

    python tests/multihost_worker.py PORT PROCESS_ID NUM_PROCESSES OUT.json CKPT_DIR

Each process has 4 simulated CPU devices (the test sets XLA_FLAGS), joins the
others through `autopar.distributed.initialize`, trains the small GPT of the
test for `STEPS` steps with `autopar.parallelize` over all 8 global devices and
then checkpoints the state into the shared CKPT_DIR, restores it onto another
plan's layout and trains one more step. It writes its losses, a per-parameter
checksum and its plan file to OUT.json (the parameters to OUT.json.params.npz).
Step 0 passes the same full arrays on every process (as with jax.jit); later
steps pass global batches built from each process's rows (`global_batch`).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autopar
import autopar.checkpoint as ckpt
import autopar.distributed as dist
from autopar.examples.models import gpt
from autopar.examples.models.common import TrainStep

CONFIG = gpt.GPTConfig(vocab=64, seq=16, hidden=32, layers=1, heads=4, batch_size=8)
MESH = {"data": 2, "model": 4}
ENGINE = "dp"
STEPS = 3
# After STEPS steps on MESH, the state is checkpointed (every process writes its shards),
# restored onto this plan's layout and trained one more step.
MESH_B, ENGINE_B = {"data": 8}, "fsdp"


def make_train_step() -> TrainStep:
    """The bundled GPT with SGD + momentum instead of AdamW: Adam divides every gradient
    element by its own RMS, so parameters whose exact gradient is zero (the attention
    key bias) would move by +-lr on rounding noise, differently in any two programs
    (see tests/test_numerics.py). With SGD every parameter compares at float32 tolerance."""
    model = gpt.GPT(CONFIG)
    tx = optax.sgd(0.5, momentum=0.9)

    def init(seed):
        tokens = jnp.zeros((CONFIG.batch_size, CONFIG.seq), jnp.int32)
        params = model.init(jax.random.key(seed), tokens)["params"]
        return {"params": params, "opt_state": tx.init(params)}

    def loss(state, batch):
        logits = model.apply({"params": state["params"]}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def step(state, batch):
        value, grads = jax.value_and_grad(lambda p: loss({"params": p}, batch))(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {"loss": value}

    batch = lambda seed: gpt.make_batch(CONFIG, seed)
    return TrainStep(step=step, init=init, batch=batch, loss=loss, name="gpt-sgd")


def leaf_name(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def param_arrays(params) -> dict[str, np.ndarray]:
    return {leaf_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def param_checksums(params) -> dict[str, list[float]]:
    """Per leaf: sum and a position-weighted sum (catches permuted values)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = np.asarray(x, np.float64).ravel()
        w = (np.arange(x.size) % 97 + 1) / 97
        out[leaf_name(path)] = [float(x.sum()), float((x * w).sum())]
    return out


def _tanh_matmul(w, x):
    return jnp.tanh(x @ w)


def disagreeing_plans() -> dict[str, object]:
    """Each process plans a tiny function with a different engine, so the plans
    differ; `broadcast_plan` must hand every process process 0's plan, and with
    `strict=True` raise on every process (not hang)."""
    w = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 2048
    x = jnp.arange(16 * 64, dtype=jnp.float32).reshape(16, 64) / 1024
    engine = "data" if jax.process_index() == 0 else "fsdp"
    mine = autopar.parallelize(_tanh_matmul, mesh=MESH, engine=engine).plan(w, x)
    got = dist.broadcast_plan(mine)
    try:
        dist.broadcast_plan(mine, strict=True)
        strict_error = ""
    except autopar.PlanError as e:
        strict_error = str(e)
    return {
        "mine": dist.plan_digest(mine),
        "got": dist.plan_digest(got),
        "got_engine": got.engine,
        "got_in_specs": str(got.in_specs),
        "strict_error": strict_error,
    }


def main(port: int, process_id: int, num_processes: int, out: str, ckpt_dir: str) -> None:
    dist.initialize(f"127.0.0.1:{port}", num_processes, process_id, initialization_timeout=60)
    ts = make_train_step()
    state = jax.jit(ts.init)(0)
    step = autopar.parallelize(ts.step, mesh=MESH, engine=ENGINE)
    plan = dist.broadcast_plan(step.plan(state, ts.batch(0)), strict=True)
    mesh = step.mesh
    rows = CONFIG.batch_size // jax.process_count()
    lo = jax.process_index() * rows
    losses = []
    for i in range(STEPS):
        batch = ts.batch(i)
        if i > 0:  # per-process rows -> global arrays
            local = jax.tree_util.tree_map(lambda x: np.asarray(x)[lo : lo + rows], batch)
            batch = dist.global_batch(local, mesh)
        state, metrics = step(state, batch)
        losses.append(float(dist.fetch(metrics["loss"])))
    # Checkpoint under plan A, resume under plan B (another mesh and engine).
    ckpt.save(ckpt_dir, state, step=STEPS)
    step_b = autopar.parallelize(ts.step, mesh=MESH_B, engine=ENGINE_B)
    abstract = jax.eval_shape(lambda: (ts.init(0), ts.batch(0)))
    state = ckpt.restore(ckpt_dir, step_b.plan(*abstract))
    resumed_specs = sorted({str(x.sharding.spec) for x in jax.tree_util.tree_leaves(state)})
    state, metrics = step_b(state, ts.batch(STEPS))
    losses.append(float(dist.fetch(metrics["loss"])))
    params = dist.fetch(state["params"])
    np.savez(out + ".params.npz", **param_arrays(params))
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_axes": list(dist.process_axes(mesh)),
        "losses": losses,
        "resumed_specs": resumed_specs,
        "checkpoint_steps": ckpt.all_steps(ckpt_dir),
        "checksums": param_checksums(params),
        "plan_json": json.dumps(plan.to_json(), sort_keys=True),
        "plan_digest": dist.plan_digest(plan),
        "disagreeing_plans": disagreeing_plans(),
        "finite": bool(all(jnp.isfinite(x).all() for x in jax.tree_util.tree_leaves(params))),
    }
    with open(out, "w") as f:
        json.dump(result, f)
    dist.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
