"""Multi-process runs: 2 local processes x 4 simulated CPU devices, joined by
`autopar.distributed.initialize` over gloo on 127.0.0.1, train a GPT with
`autopar.parallelize` over the 8 global devices; the losses and parameters must
equal a single-process `jax.jit` run, and both processes must hold the same plan.
The processes then checkpoint the state together and resume it on another mesh."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import multihost_worker as worker
import numpy as np
import pytest
from helpers import assert_trees_close
from jax.sharding import PartitionSpec

import autopar
import autopar.distributed as dist

NUM_PROCESSES = 2
TIMEOUT_S = 240  # a hang (e.g. a process waiting on a dead peer) fails instead of blocking CI


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path) -> list[dict]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    port = _free_port()
    outs = [tmp_path / f"out{i}.json" for i in range(NUM_PROCESSES)]
    logs = [tmp_path / f"log{i}.txt" for i in range(NUM_PROCESSES)]
    with contextlib.ExitStack() as stack:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    worker.__file__,
                    str(port),
                    str(i),
                    str(NUM_PROCESSES),
                    str(outs[i]),
                    str(tmp_path / "ckpt"),
                ],
                env=env,
                stdout=stack.enter_context(open(logs[i], "w")),
                stderr=subprocess.STDOUT,
            )
            for i in range(NUM_PROCESSES)
        ]
        deadline = time.monotonic() + TIMEOUT_S
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:  # only the processes this test started
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def tail(i: int) -> str:
        lines = [ln for ln in logs[i].read_text().splitlines() if not ln.startswith("[Gloo]")]
        return "\n".join(lines[-30:])

    for i, p in enumerate(procs):
        assert p.returncode == 0 and outs[i].exists(), (
            f"process {i} exited with {p.returncode} (timeout {TIMEOUT_S} s); log tail:\n{tail(i)}"
        )
    results = [json.loads(out.read_text()) for out in outs]
    for r, out in zip(results, outs):
        r["params"] = dict(np.load(f"{out}.params.npz"))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    try:
        return _launch(tmp_path_factory.mktemp("multihost"))
    except AssertionError as e:  # the free port was taken in between: once more
        if "address already in use" not in str(e).lower():
            raise
        return _launch(tmp_path_factory.mktemp("multihost"))


@pytest.fixture(scope="module")
def reference():
    """The same steps (STEPS, then one after the checkpoint), single process, single
    device, plain jax.jit, no checkpoint."""
    ts = worker.make_train_step()
    step = jax.jit(ts.step)
    state = jax.jit(ts.init)(0)
    losses = []
    for i in range(worker.STEPS + 1):
        state, metrics = step(state, ts.batch(i))
        losses.append(float(metrics["loss"]))
    params = worker.param_arrays(jax.device_get(state["params"]))
    plan = autopar.parallelize(ts.step, mesh=worker.MESH, engine=worker.ENGINE).plan(
        *jax.eval_shape(lambda: (ts.init(0), ts.batch(0)))
    )
    return {"losses": losses, "params": params, "plan": plan}


def test_processes_see_the_global_devices(runs):
    for i, r in enumerate(runs):
        assert r["process_index"] == i
        assert r["process_count"] == NUM_PROCESSES
        assert (r["device_count"], r["local_device_count"]) == (8, 4)
        assert r["process_axes"] == ["data"]  # the data axis spans the two processes


def test_losses_and_params_equal_single_process_jit(runs, reference):
    for r in runs:
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5)
        assert_trees_close(r["params"], reference["params"], rtol=1e-5, atol=1e-6)
        assert r["finite"]
        expect = worker.param_checksums(reference["params"])
        for name, sums in r["checksums"].items():
            np.testing.assert_allclose(sums, expect[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_checkpoint_written_by_both_processes_resumes_on_another_mesh(runs):
    for r in runs:
        assert r["checkpoint_steps"] == [worker.STEPS]
        assert "P(('data', 'model'), None)" not in r["resumed_specs"]  # plan A's layout
        assert any("'data'" in s for s in r["resumed_specs"]), r["resumed_specs"]


def test_plan_json_identical_on_every_process(runs, reference):
    assert runs[0]["plan_json"] == runs[1]["plan_json"]
    assert runs[0]["plan_digest"] == runs[1]["plan_digest"]
    plan = json.loads(runs[0]["plan_json"])
    # The same traced graph as in this (single-process) test process ...
    assert plan["fingerprint"] == reference["plan"].fingerprint
    # ... on the global devices: process 1's CPU devices have ids from 2048 on, so the
    # cost model (node = id // devices_per_node) sees the data axis cross nodes, as
    # two hosts would; the single-process plan may therefore differ in its costs.
    ids = plan["mesh"]["device_ids"]
    assert len(set(ids)) == 8 and ids[:4] == [0, 1, 2, 3] and min(ids[4:]) >= 4


def test_broadcast_plan_hands_out_process_0s_plan(runs):
    d0, d1 = (r["disagreeing_plans"] for r in runs)
    assert d0["mine"] != d1["mine"]  # the processes really did disagree
    assert d0["got"] == d1["got"] == d0["mine"]
    assert d1["got_engine"] == d0["got_engine"]
    assert d1["got_in_specs"] == d0["got_in_specs"]
    for d in (d0, d1):
        assert "processes [1] derived a different plan" in d["strict_error"]


# ---- the same helpers in one process (no runtime started) --------------------------------


def test_single_process_helpers():
    import jax.numpy as jnp

    mesh = autopar.make_mesh({"data": 2, "model": 4})
    assert dist.process_axes(mesh) == ()
    local = {"x": np.arange(32, dtype=np.float32).reshape(8, 4), "y": np.arange(8, dtype=np.int32)}
    g = dist.global_batch(local, mesh, PartitionSpec("data"))
    assert g["x"].sharding.spec == PartitionSpec("data")
    assert_trees_close(dist.fetch(g), local)
    g = dist.global_batch(local, mesh)  # one process: the whole batch, replicated
    assert g["x"].sharding.is_fully_replicated
    plan = autopar.parallelize(lambda w, x: jnp.tanh(x @ w), mesh=mesh).plan(
        jnp.ones((4, 4)), jnp.ones((8, 4))
    )
    assert dist.broadcast_plan(plan) is plan
    assert dist.plan_digest(plan) == dist.plan_digest(autopar.Plan.from_json(plan.to_json()))


def test_global_batch_names_the_bad_shape():
    mesh = autopar.make_mesh({"data": 8})
    with pytest.raises(dist.DistributedError, match=r"shape \(7, 4\).*P\('data',\)"):
        dist.global_batch(np.zeros((7, 4), np.float32), mesh, PartitionSpec("data"))


def test_initialize_after_the_backend_started_explains_the_fix():
    if jax.distributed.is_initialized():
        pytest.skip("runtime already initialized")
    jax.devices()  # the backend is up in this test process
    with pytest.raises(dist.DistributedError, match="before any JAX computation"):
        dist.initialize("127.0.0.1:1", 2, 0, initialization_timeout=1)
