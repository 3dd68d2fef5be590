"""`python -m autopar demo` (`make demo`): shard a small GPT over 8 simulated CPU devices.

Builds the GPT from `autopar.examples.models.gpt`, lets `autopar.parallelize` search a sharding
plan for its AdamW train step on a `data x model` mesh, prints the plan, trains a few
steps and checks every loss against the single-device `jax.jit` reference.

XLA reads `XLA_FLAGS` once, when JAX starts its backend (the first `jax.devices()` or
computation), so the simulated device count must be in the environment before then.
That is why this module imports neither jax nor autopar at the top: `main` parses its
arguments (the mesh decides how many devices to ask for), sets the environment, and
only then imports them. (`python -m autopar` has imported jax via `autopar/__init__`
already, which is fine: importing starts no backend. `JAX_PLATFORMS`, however, is read
at import, so the CPU default is applied through `jax.config` instead.)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections import Counter

DEFAULT_MESH = "data=2,model=4"
DEFAULT_STEPS = 5
RTOL = 1e-5
# Small enough to train in seconds on 2 CPU cores; big enough (3.45M parameters, 256-wide
# contractions) that the cost model's engines disagree and trade gradient all-reduces
# against activation traffic when planned for the simulated devices (`--cluster cpu`, the
# default); on h100-sxm the winner is plain 8-way data parallelism over both axes.
MODEL = dict(vocab=1024, seq=128, hidden=256, layers=4, heads=8, batch_size=16)
# make_train_step's default 1e-2 makes this GPT's loss climb; in that regime AdamW
# amplifies float32 reduction-order noise (even plain jax data parallelism drifts ~1e-5
# from single-device after 5 steps). At 1e-3 the loss falls and the runs agree to ~1e-7.
LEARNING_RATE = 1e-3
PARAM_LINES = 15


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=2,model=4"` -> `{"data": 2, "model": 4}`; ValueError with a clear message."""
    mesh: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*", part)
        if not m:
            raise ValueError(
                f"bad mesh {text!r}: expected comma-separated name=size pairs like {DEFAULT_MESH!r}, "
                f"got the piece {part!r}"
            )
        name, size = m.group(1), int(m.group(2))
        if name in mesh:
            raise ValueError(f"bad mesh {text!r}: axis {name!r} appears twice")
        if size < 1:
            raise ValueError(f"bad mesh {text!r}: axis {name!r} has size {size}, must be >= 1")
        mesh[name] = size
    return mesh


def _mesh_arg(text: str) -> dict[str, int]:
    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m autopar demo",
        description="Shard a small GPT train step over simulated CPU devices with autopar "
        "and check its losses against single-device jax.jit.",
    )
    p.add_argument(
        "--mesh",
        type=_mesh_arg,
        default=parse_mesh(DEFAULT_MESH),
        metavar="NAME=SIZE,...",
        help=f"mesh axes and sizes (default: {DEFAULT_MESH})",
    )
    p.add_argument(
        "--engine",
        default="auto",
        help="search engine, e.g. recursive, dp, ilp, data, fsdp (default: auto, tries several)",
    )
    p.add_argument(
        "--cluster",
        default="cpu",
        help="cost profile to plan for (default: cpu, the simulated devices this runs on; "
        "on a GPU profile this small model is planned as plain data parallelism)",
    )
    p.add_argument(
        "--pipeline-stages",
        type=_positive,
        metavar="S",
        help="run the layers under nn.scan as a pipeline (1F1B) over the mesh's 'stage' axis "
        "(e.g. --mesh stage=2,data=2,model=2 --pipeline-stages 2)",
    )
    p.add_argument(
        "--pipeline-schedule",
        choices=("1f1b", "1f1b-async", "gpipe"),
        help="default: 1f1b where it applies",
    )
    p.add_argument(
        "--grad-accumulation", type=_positive, metavar="M", help="accumulate over M micro-batches"
    )
    p.add_argument(
        "--remat",
        choices=("dots", "selective", "full", "auto"),
        help="rematerialize the layer loop (layers under nn.scan)",
    )
    p.add_argument(
        "--steps",
        type=_positive,
        default=DEFAULT_STEPS,
        help=f"training steps (default: {DEFAULT_STEPS})",
    )
    return p


def setup_env(num_devices: int) -> None:
    """Ask XLA for `num_devices` host devices unless XLA_FLAGS already sets a count.
    Must run before JAX starts its backend (see the module docstring)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flag = f"--xla_force_host_platform_device_count={num_devices}"
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def _backend_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(bridge, "backends_are_initialized", None)
    return bool(started and started())


def _rule(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 74 - len(title)))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    mesh: dict[str, int] = args.mesh
    need = math.prod(mesh.values())
    backend_started = _backend_started()
    setup_env(max(8, need))

    # Imported only now: see the module docstring.
    import jax
    import numpy as np

    if "JAX_PLATFORMS" not in os.environ and not backend_started:
        # The reference comparison is at rtol 1e-5: run on CPU (no TF32 matmuls).
        jax.config.update("jax_platforms", "cpu")

    import autopar
    from autopar.examples.models import gpt
    from autopar.search import ENGINES

    engines = ("auto", *ENGINES)
    if args.engine not in engines:
        print(
            f"error: unknown engine {args.engine!r}; choose one of: {', '.join(engines)}",
            file=sys.stderr,
        )
        return 2
    have = len(jax.devices())
    if have < need:
        hint = (
            "JAX's backend started before the demo could set XLA_FLAGS"
            if backend_started
            else f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
        )
        print(
            f"error: mesh {mesh} needs {need} devices but only {have} are available ({hint}); "
            f"run with XLA_FLAGS=--xla_force_host_platform_device_count={need}",
            file=sys.stderr,
        )
        return 2

    t_start = time.perf_counter()
    scan = bool(args.pipeline_stages or args.remat)
    cfg = gpt.GPTConfig(**MODEL, scan_layers=scan)
    ts = gpt.make_train_step(cfg, learning_rate=LEARNING_RATE)
    state = ts.init(0)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    mesh_str = " x ".join(f"{k}={v}" for k, v in mesh.items())
    print(
        f"autopar demo: GPT (hidden {cfg.hidden}, heads {cfg.heads}, layers {cfg.layers}, "
        f"seq {cfg.seq}, vocab {cfg.vocab}, batch {cfg.batch_size}; {n_params / 1e6:.2f}M params, "
        f"AdamW lr {LEARNING_RATE:g}) "
        f"on {have} {jax.devices()[0].platform.upper()} devices, mesh {mesh_str}, engine {args.engine}"
    )
    # The sharded step donates (consumes) its state: keep a host copy for the reference.
    ref_state = jax.tree.map(np.array, state)

    step = autopar.parallelize(
        ts.step,
        mesh=mesh,
        engine=args.engine,
        cluster=args.cluster,
        donate_argnums=(0,),
        pipeline_stages=args.pipeline_stages,
        pipeline_schedule=args.pipeline_schedule,
        grad_accumulation=args.grad_accumulation,
        remat=args.remat,
    )
    ref_step = jax.jit(ts.step)

    _rule("plan")
    t0 = time.perf_counter()
    plan = step.plan(state, ts.batch(0))
    print(f"(traced and searched in {time.perf_counter() - t0:.1f} s)")
    print(plan.summary())
    params = [r for r in plan.inputs if "params" in r.path.split("/")]
    n_sharded = sum(bool(r.spec.used_axes) for r in params)
    shown = sorted(params, key=lambda r: -math.prod(r.shape))[:PARAM_LINES]
    width = max((len(r.path) for r in shown), default=10)
    print(
        f"\nparameter input shardings: {n_sharded} of {len(params)} sharded "
        f"(R = replicated, S[axes] = split over mesh axes); the {len(shown)} largest:"
    )
    for r in shown:
        print(f"  {r.path:<{width}}  {r.dtype}{list(r.shape)}  {r.spec}")
    matmuls = Counter(o.strategy for o in plan.ops if o.op == "dot_general")
    print(f"\nmost common of {sum(matmuls.values())} dot_general strategies:")
    for strategy, n in matmuls.most_common(3):
        print(f"  {n:>4} x  {strategy}")

    _rule(f"training {args.steps} steps")
    print(f"{'step':>4}  {'autopar loss':>14}  {'jax.jit loss':>14}  {'|diff|':>10}")
    losses, ref_losses = [], []
    for i in range(args.steps):
        batch = ts.batch(i)
        state, metrics = step(state, batch)
        ref_state, ref_metrics = ref_step(ref_state, batch)
        loss, ref_loss = float(metrics["loss"]), float(ref_metrics["loss"])
        losses.append(loss)
        ref_losses.append(ref_loss)
        print(f"{i:>4}  {loss:>14.8f}  {ref_loss:>14.8f}  {abs(loss - ref_loss):>10.2e}")

    _rule("result")
    for part in ("params", "opt_state"):
        leaves = [
            (p, x)
            for p, x in jax.tree_util.tree_leaves_with_path(state[part])
            if isinstance(x, jax.Array) and x.ndim
        ]
        devices = sorted({len(x.sharding.device_set) for _, x in leaves})
        sharded = [(p, x) for p, x in leaves if not x.sharding.is_fully_replicated]
        print(
            f"returned {part} live on {'/'.join(map(str, devices))} devices: "
            f"{len(sharded)} of {len(leaves)} arrays sharded"
            + (", the rest replicated" if len(sharded) < len(leaves) else "")
        )
        if sharded:
            p, x = max(sharded, key=lambda px: px[1].size)
            shard = x.addressable_shards[0].data.shape
            print(
                f"  e.g. {part}{jax.tree_util.keystr(p)} {list(x.shape)}: "
                f"{x.sharding.spec}, {list(shard)} per device"
            )
    param_diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"]))
    )
    print(f"max |param difference| after {args.steps} steps: {param_diff:.2e}")
    ok = bool(np.allclose(losses, ref_losses, rtol=RTOL))
    verdict = "MATCH" if ok else "MISMATCH"
    print(
        f"{verdict}: autopar losses {'match' if ok else 'do not match'} single-device jax.jit "
        f"(np.allclose, rtol {RTOL:g}); demo took {time.perf_counter() - t_start:.1f} s"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
