"""`autopar calibrate`: measure the local devices and write a cluster profile (TOML).

Microbenchmarks, each a jitted program timed with `block_until_ready` (the median
of a few repetitions after a warm-up run that also compiles it):

* **matmul** FLOP/s per dtype (`float32`, `bfloat16`): an n x n by n x n matmul on
  one device, n doubled until one run takes long enough to time;
* **memory bandwidth**: `x + 1` over a large float32 array on one device (one read
  and one write of every byte);
* **collectives**: all-reduce (`psum`), all-gather, reduce-scatter (`psum_scatter`)
  and all-to-all over every mesh axis, in `jax.shard_map`, at a few message sizes.
  Bytes follow the cost model's convention (`autopar.cost.model`): the full-size
  per-device buffer (all-reduce: the buffer; all-gather: the result;
  reduce-scatter: the input; all-to-all: the buffer).

Each mesh axis is a link tier: intra-node when each of its device groups stays in
one process (host), else inter-node. Per tier, `t = alpha + factor(n) x bytes / beta`
is fitted to every collective's timings (least squares on relative error), with
the same nccl-tests bus-bandwidth factors the cost model uses, so the profile
prices collectives the way they were measured. The profile's efficiencies are
1.0: the figures are achieved, not peak.

On a CPU with simulated devices the figures are the CPU's (collectives are memory
copies inside one process); they are good for testing the tooling, not for
planning GPU clusters.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from autopar.cost.model import BUS_FACTOR
from autopar.errors import MeshError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Settings:
    reps: int
    matmul_target_s: float  # grow the matmul until one run takes this long
    matmul_max_n: int
    mem_bytes: int
    coll_bytes: tuple[int, ...]


def settings(platform: str, quick: bool) -> Settings:
    gpu = platform in ("gpu", "cuda", "rocm", "tpu")
    if quick:
        return Settings(
            reps=3,
            matmul_target_s=0.03,
            matmul_max_n=8192 if gpu else 1024,
            mem_bytes=(256 << 20) if gpu else (32 << 20),
            coll_bytes=(64 << 10, 1 << 20, 8 << 20) if gpu else (64 << 10, 1 << 20, 4 << 20),
        )
    return Settings(
        reps=7,
        matmul_target_s=0.2,
        matmul_max_n=16384 if gpu else 4096,
        mem_bytes=(2 << 30) if gpu else (256 << 20),
        coll_bytes=(
            (32 << 10, 512 << 10, 8 << 20, 64 << 20, 256 << 20)
            if gpu
            else (16 << 10, 256 << 10, 4 << 20, 32 << 20)
        ),
    )


def time_it(fn: Callable, *args, reps: int) -> float:
    """Median seconds of `fn(*args)` (blocking on the result), after one warm-up run."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------- compute


def matmul_flops(device, dtype: str, s: Settings, log=None) -> tuple[float, int]:
    """Achieved FLOP/s of an n x n matmul in `dtype` on `device`, and the n used."""
    import jax
    import jax.numpy as jnp

    mm = jax.jit(lambda a, b: a @ b)
    n, best = 256, (0.0, 256)
    while True:
        key = jax.random.PRNGKey(n)
        a = jax.device_put(jax.random.normal(key, (n, n), jnp.float32).astype(dtype), device)
        b = jax.device_put(jnp.ones((n, n), dtype), device)
        t = time_it(mm, a, b, reps=s.reps)
        flops = 2.0 * n**3 / t
        best = max(best, (flops, n))
        if log:
            log(f"  matmul {dtype:>8} n={n:<5} {t * 1e3:9.2f} ms  {flops / 1e12:9.4f} TFLOP/s")
        if t >= s.matmul_target_s or n * 2 > s.matmul_max_n:
            return best
        n *= 2


def memory_bandwidth(device, s: Settings, log=None) -> float:
    """Achieved bytes/s of `x + 1` over `s.mem_bytes` of float32 (read + write)."""
    import jax
    import jax.numpy as jnp

    n = s.mem_bytes // 4
    x = jax.device_put(jnp.zeros((n,), jnp.float32), device)
    add = jax.jit(lambda x: x + 1.0)
    t = time_it(add, x, reps=s.reps)
    bw = 2 * s.mem_bytes / t
    if log:
        log(f"  x + 1 over {s.mem_bytes >> 20} MiB: {t * 1e3:.2f} ms  {bw / 1e9:.2f} GB/s")
    return bw


def device_memory_bytes(device) -> tuple[float, str]:
    """The device's memory and where the figure comes from."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), "the device's bytes_limit"
    import jax

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16e9
    n = max(1, jax.local_device_count())
    return float(total) / n, f"host RAM / {n} local devices"


# ---------------------------------------------------------------------------- collectives


def _collective_fn(kind: str, mesh, axis: str, local_elems: int):
    """A jitted shard_map running one `kind` collective over `axis`; its input, a float32
    array whose per-device block has `local_elems` elements."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    all_axes = tuple(mesh.axis_names)
    spec = P(all_axes)

    def body(x):
        if kind == "all-reduce":
            return jax.lax.psum(x, axis)
        if kind == "all-gather":
            return jax.lax.all_gather(x, axis, tiled=True)
        if kind == "reduce-scatter":
            return jax.lax.psum_scatter(x, axis, tiled=True)
        if kind == "all-to-all":
            return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
        raise ValueError(kind)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    n = local_elems * mesh.size
    x = jax.device_put(jnp.ones((n,), jnp.float32), NamedSharding(mesh, spec))
    return fn, x


def measure_collective(kind: str, mesh, axis: str, nbytes: int, reps: int) -> tuple[int, float]:
    """(bytes as the cost model counts them, median seconds) of one collective."""
    k = mesh.shape[axis]
    # the per-device buffer the cost model counts is the input, except for all-gather
    # (the result, k times the input)
    elems = max(k, nbytes // 4)
    if kind == "all-gather":
        elems = max(1, elems // k)
    elems = -(-elems // k) * k  # reduce-scatter / all-to-all split the block k ways
    fn, x = _collective_fn(kind, mesh, axis, elems)
    t = time_it(fn, x, reps=reps)
    counted = elems * 4 * (k if kind == "all-gather" else 1)
    return counted, t


def axis_is_inter(mesh, axis: str) -> bool:
    """True when some group of devices along `axis` spans several processes (hosts)."""
    i = mesh.axis_names.index(axis)
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    groups = np.moveaxis(procs, i, -1).reshape(-1, mesh.devices.shape[i])
    return bool((groups != groups[:, :1]).any())


@dataclass(frozen=True)
class Fit:
    alpha: float  # s
    beta: float  # bytes/s
    points: int
    rel_err: float  # median |predicted - measured| / measured


def fit_alpha_beta(samples: list[tuple[float, float]]) -> Fit:
    """Fit t = alpha + x / beta to (x, t) pairs (x: bus-factor-scaled bytes), least squares
    on relative error. alpha is kept positive (at least 0.1 µs)."""
    x = np.array([s[0] for s in samples], float)
    t = np.array([s[1] for s in samples], float)
    w = 1.0 / t
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (alpha, slope), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if not slope > 0:  # noise: take the best achieved bandwidth
        slope = float(np.min(t / np.maximum(x, 1)))
    alpha = float(alpha)
    if not alpha > 1e-7:
        alpha = max(1e-7, float(np.min(t - x * slope)) if np.any(t - x * slope > 0) else 1e-7)
    pred = alpha + x * slope
    return Fit(alpha, 1.0 / float(slope), len(samples), float(np.median(np.abs(pred - t) / t)))


# ---------------------------------------------------------------------------- the profile


def _num(v: float) -> str:
    """A TOML float with 4 significant digits (never 0 for a positive value)."""
    return repr(float(f"{v:.4g}"))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def calibrate(
    out: str,
    mesh: dict[str, int] | None = None,
    quick: bool = False,
    name: str | None = None,
    log: Callable[[str], None] | None = print,
):
    """Run the microbenchmarks on the local devices and write the profile to `out`.
    Returns the loaded `cost_models.ClusterProfile`."""
    import jax

    import cost_models
    from autopar.meshes import make_mesh

    log = log or (lambda s: None)
    t_start = time.perf_counter()
    devices = jax.devices()
    dev = devices[0]
    platform, kind = dev.platform, str(getattr(dev, "device_kind", dev.platform))
    mesh = dict(mesh) if mesh else {"data": len(devices)}
    if math.prod(mesh.values()) > len(devices):
        raise MeshError(
            f"calibrate runs on real devices: mesh {mesh} needs {math.prod(mesh.values())} "
            f"but there are {len(devices)} ({platform})"
        )
    jmesh = make_mesh(mesh)
    s = settings(platform, quick)
    log(
        f"calibrating {len(devices)} {platform} device(s) ({kind}; {jax.process_count()} "
        f"process(es)) on mesh {mesh}{' (quick)' if quick else ''}"
    )

    log("compute:")
    peaks = {}
    matmul_n = {}
    for dt in DTYPES:
        peaks[dt], matmul_n[dt] = matmul_flops(dev, dt, s, log)
    log("memory:")
    hbm_bw = memory_bandwidth(dev, s, log)
    hbm_bytes, hbm_from = device_memory_bytes(dev)

    log("collectives:")
    tiers: dict[str, list[tuple[float, float]]] = {"intra": [], "inter": []}
    per_kind: dict[tuple[str, str], list[tuple[float, float]]] = {}
    rows = []
    for axis, size in mesh.items():
        if size < 2:
            continue
        tier = "inter" if axis_is_inter(jmesh, axis) else "intra"
        for k in KINDS:
            for b in s.coll_bytes:
                nbytes, t = measure_collective(k, jmesh, axis, b, s.reps)
                x = BUS_FACTOR[k](size) * nbytes
                tiers[tier].append((x, t))
                per_kind.setdefault((tier, k), []).append((x, t))
                rows.append((axis, size, tier, k, nbytes, t))
                log(
                    f"  {k:<14} over {axis}={size} ({tier}-node) {nbytes / 2**20:8.3f} MiB  "
                    f"{t * 1e6:10.1f} µs  bus {x / t / 1e9:8.3f} GB/s"
                )

    fits = {tier: fit_alpha_beta(v) for tier, v in tiers.items() if len(v) >= 2}
    notes = []
    if "intra" not in fits and "inter" not in fits:
        # one device: no link to measure; price collectives like a memory copy
        fits["intra"] = Fit(1e-6, hbm_bw / 2, 0, 0.0)
        notes.append("no mesh axis of size > 1: links not measured (set to memory speed)")
    if "intra" not in fits:
        fits["intra"] = fits["inter"]
        notes.append("intra-node link not measured: copied from the inter-node fit")
    if "inter" not in fits:
        fits["inter"] = fits["intra"]
        notes.append("inter-node link not measured (one host): copied from the intra-node fit")
    per_kind_fits = {key: fit_alpha_beta(v) for key, v in per_kind.items() if len(v) >= 2}

    name = name or f"calibrated-{_slug(platform)}-{_slug(kind)}"
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    description = (
        f"Measured by `autopar calibrate` on {len(devices)} {platform} device(s) ({kind}), "
        f"mesh {','.join(f'{a}={n}' for a, n in mesh.items())}, {when}. Achieved figures "
        "(matmul, x + 1, shard_map collectives), so every efficiency is 1.0."
        + (" " + "; ".join(notes) + "." if notes else "")
        + (
            " CPU figures with simulated devices: for testing, not for planning GPU clusters."
            if platform == "cpu"
            else ""
        )
    )
    lines = [
        f"# Cluster profile measured by `autopar calibrate`{' --quick' if quick else ''} on {when}.",
        f"# {len(devices)} {platform} device(s), {kind}; {jax.process_count()} process(es); "
        f"mesh {mesh}.",
        "# Units: TFLOP/s, GB (1e9 bytes), GB/s (1e9 bytes/s), microseconds.",
        "# Measured (achieved) figures, so the efficiencies are 1.0.",
        "",
        f"name = {json.dumps(name)}",
        f"description = {json.dumps(description)}",
        "",
        f"[peak_flops_tflops]  # achieved by a jitted n x n matmul (median of {s.reps} runs)",
    ]
    for dt in DTYPES:
        lines.append(f"{dt} = {_num(peaks[dt] / 1e12)}  # n = {matmul_n[dt]}")
    lines += [
        "",
        "[memory]",
        f"hbm_gb = {_num(hbm_bytes / 1e9)}  # {hbm_from}",
        f"hbm_bandwidth_gbps = {_num(hbm_bw / 1e9)}  # x + 1 over {s.mem_bytes >> 20} MiB "
        "of float32 (read + write)",
        "",
        "[network]  # t = latency + bus factor x bytes / bandwidth, fitted per link tier",
        f"devices_per_node = {jax.local_device_count()}",
    ]
    for tier in ("intra", "inter"):
        f = fits[tier]
        src = f"fit to {f.points} timings, median error {f.rel_err * 100:.0f}%" if f.points else ""
        if not tiers[tier]:
            src = "not measured: " + ("copied" if f.points else "memory speed")
        lines.append(f"{tier}_bandwidth_gbps = {_num(f.beta / 1e9)}  # {src}")
        lines.append(f"{tier}_latency_us = {_num(f.alpha * 1e6)}")
    lines += [
        "",
        "[efficiency]  # measured figures: nothing to discount",
        "compute = 1.0",
        "hbm = 1.0",
        "intra_link = 1.0",
        "inter_link = 1.0",
        "",
        "# Per-collective fits (for reference; the cost model uses one fit per link tier):",
    ]
    for (tier, k), f in sorted(per_kind_fits.items()):
        lines.append(
            f"#   {tier:<5} {k:<14} latency {f.alpha * 1e6:9.2f} us  bus bandwidth "
            f"{f.beta / 1e9:9.3f} GB/s"
        )
    lines.append("# Timings (axis, size, tier, collective, bytes, median seconds):")
    for axis, size, tier, k, nbytes, t in rows:
        lines.append(f"#   {axis}={size} {tier} {k} {nbytes} {t:.6g}")
    with open(out, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    profile = cost_models.load(Path(out))  # what --cluster PATH will read
    log(
        f"profile {profile.name!r} written to {out} in {time.perf_counter() - t_start:.1f} s: "
        f"float32 {profile.peak_flops['float32'] / 1e12:.4g} TFLOP/s, bfloat16 "
        f"{profile.peak_flops['bfloat16'] / 1e12:.4g} TFLOP/s, memory {hbm_bw / 1e9:.3g} GB/s, "
        f"intra-node {fits['intra'].beta / 1e9:.3g} GB/s + {fits['intra'].alpha * 1e6:.3g} µs, "
        f"inter-node {fits['inter'].beta / 1e9:.3g} GB/s + {fits['inter'].alpha * 1e6:.3g} µs"
    )
    return profile
