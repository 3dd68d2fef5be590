"""Shared test helpers: dtype-aware tree comparison and a small training loop."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

# (rtol, atol) per dtype, for comparing a sharded program with the single-device one.
# Sharding changes only the order of floating-point sums (partial sums per shard, then
# a cross-device all-reduce), so the defaults are a few ulps of each type's epsilon.
TOLERANCES: dict[Any, tuple[float, float]] = {
    jnp.dtype(jnp.float64): (1e-12, 1e-12),
    jnp.dtype(jnp.float32): (1e-5, 1e-5),
    jnp.dtype(jnp.bfloat16): (1e-2, 1e-2),
    jnp.dtype(jnp.float16): (1e-3, 1e-3),
}


def tolerance(dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype``; integers and booleans compare exactly."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return 0.0, 0.0
    return TOLERANCES.get(dtype, TOLERANCES[jnp.dtype(jnp.float32)])


def _describe(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def assert_trees_close(
    actual,
    expected,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    what: str = "",
) -> None:
    """Assert two pytrees have the same structure, shapes, dtypes and close values.

    Tolerances default per leaf to ``tolerance(expected_leaf.dtype)``; ``rtol``/``atol``
    override them for floating-point leaves (integer leaves always compare exactly).
    The failure message names the leaf path, the worst element and its two values.
    """
    a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, e_tree = jax.tree_util.tree_flatten_with_path(expected)
    prefix = f"{what}: " if what else ""
    assert a_tree == e_tree, f"{prefix}tree structures differ:\n  {a_tree}\n  {e_tree}"
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        name = f"{prefix}{_describe(path)}"
        assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != {e.dtype}"
        r, t = tolerance(e.dtype)
        if jnp.issubdtype(e.dtype, jnp.inexact):
            r = r if rtol is None else rtol
            t = t if atol is None else atol
        if r == 0 and t == 0:
            if not np.array_equal(a, e):
                bad = np.argwhere(a != e)[0]
                raise AssertionError(
                    f"{name}: values differ at {tuple(bad)}: {a[tuple(bad)]} != {e[tuple(bad)]} "
                    f"({int((a != e).sum())} of {a.size} elements)"
                )
            continue
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        err = np.abs(a64 - e64)
        allowed = t + r * np.abs(e64)
        nan_mismatch = np.isnan(a64) != np.isnan(e64)
        bad = (err > allowed) | nan_mismatch
        bad &= ~(np.isnan(a64) & np.isnan(e64))
        if bad.any():
            ratio = np.where(bad, np.nan_to_num(err / allowed, nan=np.inf), 0)
            i = np.unravel_index(int(np.argmax(ratio)), a.shape)
            raise AssertionError(
                f"{name}: {int(bad.sum())} of {a.size} elements differ beyond rtol={r}, atol={t}; "
                f"worst at {tuple(int(x) for x in i)}: {a[i]!r} vs {e[i]!r} "
                f"(|diff| {err[i]:.3g}, allowed {allowed[i]:.3g}); max |diff| {np.nanmax(err):.3g}"
            )


def run_steps(
    step_fn: Callable, state, batch_fn: Callable[[int], Any], n: int, *, keep_states: bool = False
):
    """Run ``state, metrics = step_fn(state, batch_fn(i))`` for ``i in range(n)``.

    Returns ``(losses, final_state)``; with ``keep_states=True`` returns
    ``(losses, states)`` where ``states[i]`` is the state after step ``i``.
    ``metrics`` may be a scalar loss or a dict holding ``"loss"``.
    """
    losses, states = [], []
    for i in range(n):
        state, metrics = step_fn(state, batch_fn(i))
        loss = metrics["loss"] if isinstance(metrics, dict) else metrics
        losses.append(loss)
        states.append(state)
    return losses, (states if keep_states else state)


def shard_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh) -> tuple[int, ...]:
    """Per-device block shape of a ``shape`` array laid out as ``spec`` on ``mesh``."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    entries = list(spec) + [None] * (len(shape) - len(spec))
    out = []
    for dim, entry in zip(shape, entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(math.ceil(dim / math.prod(sizes[a] for a in axes)))
    return tuple(out)


def is_sharded(spec: PartitionSpec) -> bool:
    """True when ``spec`` splits some dimension over a mesh axis."""
    return any(entry is not None and entry != () for entry in spec)


def spec_leaves(tree) -> list[PartitionSpec]:
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


# ---- the CLI through its real entry point ------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = REPO_ROOT, env_extra: dict | None = None, timeout: float = 240):
    """`python -m autopar ARGS` with neither XLA_FLAGS nor JAX_PLATFORMS set, so the CLI
    sets up its simulated devices itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "autopar", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(r) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def bad_input(r, *needles: str) -> str:
    """Exit status 2, exactly one line on stderr, no traceback."""
    assert r.returncode == 2, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def replay_from_file(step, fn: Callable, args: tuple, tmp_path: Path, **parallelize_kw):
    """Save `step`'s plan for `args`, check the file against the schema, and run `fn`
    from that file: it must give bit-identical results. Returns the replayed plan."""
    import json

    from test_cli import SCHEMA, check_schema

    import autopar

    path = tmp_path / "plan.json"
    step.plan(*args).save(path)
    assert check_schema(json.loads(path.read_text()), SCHEMA) == []
    replay = autopar.parallelize(fn, plan=path, **parallelize_kw)
    assert_trees_close(replay(*args), step(*args), rtol=0, atol=0)
    return replay.plan(*args)
