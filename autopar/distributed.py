"""Multi-process (multi-host) runs: start JAX's distributed runtime, build global
batches from per-process shards, and make every process use the same plan.

autopar adds no runtime of its own: `jax.distributed` is the engine, and
`autopar.parallelize` runs multi-process exactly as `jax.jit` does. Every process
runs the same program on the same arguments: either the same full arrays (each
process places its own shards) or global `jax.Array`s (see `global_batch`).

    autopar.distributed.initialize()          # Slurm, Open MPI, TPU: auto-detected
    # or: initialize("10.0.0.1:1234", num_processes=2, process_id=rank)
    step = autopar.parallelize(train_step, mesh={"data": 2, "model": 4})
    plan = autopar.distributed.broadcast_plan(step.plan(state, batch))
    batch = autopar.distributed.global_batch(local_batch, step.mesh)
    state, metrics = step(state, batch)

On CPU (tests, laptops) the processes talk over gloo: `initialize` sets
`jax_cpu_collectives_implementation` before the backend starts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.errors import DistributedError, PlanError
from autopar.plan.plan import Plan


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_collectives: str | None = "gloo",
    **kw: Any,
) -> None:
    """Start JAX's distributed runtime; a thin layer over `jax.distributed.initialize`.

    With no arguments, JAX detects the launcher (Slurm, Open MPI, TPU pods, ...).
    Otherwise pass the coordinator `host:port` (process 0's address), the number of
    processes and this process's id. `cpu_collectives` ("gloo" or "mpi"; None to
    leave JAX's setting) is the CPU backend's cross-process transport, needed when
    the devices are CPUs; it is harmless on GPUs. Extra keyword arguments
    (`local_device_ids`, `initialization_timeout`, ...) go to JAX unchanged.
    Call it once, before any other JAX call; a second call is a no-op.
    """
    if jax.distributed.is_initialized():
        return
    previous = jax.config.jax_cpu_collectives_implementation
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kw)
    except RuntimeError as e:
        jax.config.update("jax_cpu_collectives_implementation", previous)
        raise DistributedError(
            f"jax.distributed.initialize({coordinator_address!r}, num_processes={num_processes}, "
            f"process_id={process_id}) failed: {e}\n"
            "Call autopar.distributed.initialize() first thing in the program, before any "
            "JAX computation or jax.devices(); check that every process uses the same "
            "coordinator address and process count, and that the port is reachable."
        ) from e


def shutdown() -> None:
    """Stop the distributed runtime (`jax.distributed.shutdown`)."""
    jax.distributed.shutdown()


def process_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which devices belong to different processes.

    A batch sharded over these axes (and nothing else) lets each process hold a
    contiguous slice of it. For `make_mesh({"data": 2, "model": 4})` on 2 processes
    x 4 devices this is `("data",)`; on one process it is `()`.
    """
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return tuple(
        name
        for k, name in enumerate(mesh.axis_names)
        if not (procs == np.take(procs, [0], axis=k)).all()
    )


def global_batch(local_batch: Any, mesh: Mesh, spec: Any = None) -> Any:
    """Turn each process's part of a batch into global `jax.Array`s.

    `local_batch` is a pytree of this process's arrays; `spec` a PartitionSpec (or a
    pytree prefix of `local_batch` of them) saying how the *global* batch is laid out
    on `mesh`. Each process supplies the rows its devices hold under `spec`
    (`jax.make_array_from_process_local_data`). By default `spec` shards the leading
    (batch) dim over `process_axes(mesh)`: with P processes, process p passes rows
    `[p * B/P, (p + 1) * B/P)` of a global batch of B rows — what a per-host data
    loader yields. `autopar.parallelize` moves the result to its plan's layout.
    """
    if spec is None:
        axes = process_axes(mesh)
        spec = PartitionSpec(axes if axes else None)
    is_spec = lambda x: x is None or isinstance(x, PartitionSpec)
    leaves, tree = jax.tree_util.tree_flatten(local_batch)
    try:
        specs = jax.tree_util.tree_flatten(
            jax.tree_util.tree_map(
                lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub),
                spec,
                local_batch,
                is_leaf=is_spec,
            )
        )[0]
    except ValueError as e:
        raise DistributedError(
            f"global_batch: spec {spec} is not a PartitionSpec or a pytree prefix of the batch: {e}"
        ) from None
    out = []
    for x, s in zip(leaves, specs):
        sharding = NamedSharding(mesh, s if s is not None else PartitionSpec())
        try:
            out.append(jax.make_array_from_process_local_data(sharding, np.asarray(x)))
        except ValueError as e:
            raise DistributedError(
                f"global_batch: process {jax.process_index()} passed a local array of shape "
                f"{np.shape(x)} that cannot be laid out as {s} on mesh "
                f"{dict(zip(mesh.axis_names, mesh.axis_sizes))} across {jax.process_count()} "
                f"processes: {e}\nEach process passes the rows its devices hold under the spec; "
                "make the global batch divisible by the sizes of the axes sharding it (pad or "
                "drop the remainder), or pass another spec."
            ) from None
    return jax.tree_util.tree_unflatten(tree, out)


def plan_bytes(plan: Plan) -> bytes:
    """The plan file's content, as bytes. Byte-identical for the same function,
    arguments, mesh and profile: autopar's search is deterministic."""
    return json.dumps(plan.to_json(), sort_keys=True).encode()


def plan_digest(plan: Plan) -> str:
    """SHA-256 of `plan_bytes(plan)`."""
    return hashlib.sha256(plan_bytes(plan)).hexdigest()


def broadcast_plan(plan: Plan, *, strict: bool = False) -> Plan:
    """Give every process process 0's plan. Collective: every process must call it.

    The processes first compare plan digests (an all-gather of 32 bytes). When they
    agree, which is the normal case since the search is deterministic, `plan` comes
    back unchanged. Otherwise process 0's plan file is broadcast and returned on
    every process (bound to this process's function and mesh), or, with
    `strict=True`, every process raises `PlanError` listing which processes differ.
    Pass the result to `autopar.parallelize(fn, mesh=..., plan=...)`.
    """
    data = plan_bytes(plan)
    digest = np.frombuffer(hashlib.sha256(data).digest(), dtype=np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, digest.size)
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if not differ:
        return plan
    if strict:
        raise PlanError(
            f"processes {differ} derived a different plan from process 0 for "
            f"{plan.function or 'the function'} (fingerprint {plan.fingerprint} here). "
            "Every process must trace the same function on the same argument shapes, "
            "with the same mesh, cluster profile and autopar/JAX versions."
        )
    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
    buf = np.zeros(n, np.uint8)
    if jax.process_index() == 0:
        buf[:] = np.frombuffer(data, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf)).astype(np.uint8)
    chosen = Plan.from_json(json.loads(buf.tobytes()), "process 0's plan")
    return replace(chosen, in_tree=plan.in_tree, out_tree=plan.out_tree, jax_mesh=plan.jax_mesh)


def fetch(tree: Any) -> Any:
    """Global arrays -> full numpy arrays on every process (collective; for logging
    and checks, not for big tensors). Fully addressable leaves are just copied."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree_util.tree_map(one, tree)
