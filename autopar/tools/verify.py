"""`autopar verify`: compile a function with a plan and compare the plan's predicted
communication and memory with what XLA compiled; optionally run it against `jax.jit`."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autopar.errors import UsageError, format_bytes

if TYPE_CHECKING:
    from autopar.plan.plan import Plan

NUMERICS_RTOL = 1e-5  # scalar outputs (losses)
NUMERICS_GLOBAL_RTOL = 1e-4  # all outputs together: ||sharded - jit|| / ||jit||


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its type name if it has none)."""
    lines = [s.strip() for s in str(e).strip().splitlines() if s.strip()]
    # lines joined as sentences: one that ends without a stop gets one
    text = " ".join(
        s if i == len(lines) - 1 or s.endswith((".", ":", ";")) else s + "."
        for i, s in enumerate(lines)
    )
    return text or type(e).__name__


def mesh_text(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in mesh.items())


def verify(
    plan: Plan,
    plan_path: str,
    target: str,
    allow_partial: bool = False,
    numerics: bool = False,
    prepare_backend: Callable[[int], None] | None = None,
) -> int:
    """Print `autopar verify` for `plan` (read from `plan_path`) and TARGET. Returns the
    exit status: 0 if it compiles (and, with `numerics`, matches `jax.jit`), else 1.
    `prepare_backend(num_devices)` runs before JAX starts its backend."""
    mesh = plan.mesh.shape
    n = plan.mesh.num_devices
    if prepare_backend is not None:
        prepare_backend(n)
    import jax

    have = len(jax.devices())
    if have < n:
        raise UsageError(
            f"verify compiles for all {n} devices of the plan's mesh {mesh_text(mesh)} but only {have} "
            f"are available (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}); "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    import cost_models
    from autopar.api import parallelize
    from autopar.tools.hlo import parse_collectives
    from autopar.tools.workload import load_target

    wl = load_target(target)
    step = parallelize(
        wl.fn,
        mesh=mesh,
        cluster=cost_models.ClusterProfile.from_dict(plan.cluster),
        plan=plan_path,
        static_argnums=wl.static_argnums,
        # as the plan was searched (`autopar search --donate`), else as the workload says
        donate_argnums=plan.donate_argnums
        if plan.donate_argnums is not None
        else wl.donate_argnums,
        allow_partial=allow_partial,
    )
    t0 = time.perf_counter()
    lowered = step.lower(*wl.args)  # PlanError if the plan is not for this function
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - a verification failure, reported
        print(
            f"autopar verify: FAILED: the planned program does not compile: {one_line(e)}",
            file=sys.stderr,
        )
        return 1
    seconds = time.perf_counter() - t0
    colls = parse_collectives(compiled.as_text(), step.mesh)
    print(
        f"verify {plan_path} against {wl.name or target}: compiled for mesh {mesh_text(mesh)} "
        f"on {n} {jax.devices()[0].platform.upper()} devices in {seconds:.1f} s: OK"
    )
    print_communication(plan, colls)
    print_memory(plan, compiled.memory_analysis())
    if numerics:
        return verify_numerics(wl, mesh, plan_path)
    return 0


def print_communication(plan: Plan, colls: list) -> None:
    """The predicted and compiled bytes per collective kind and mesh axes."""
    from autopar.tools.hlo import summarize
    from autopar.tools.inspect.format import comm_key

    predicted: dict[tuple[str, tuple[str, ...]], int] = {}
    for k, b in plan.cost.comm_bytes.items():
        predicted[comm_key(k)] = predicted.get(comm_key(k), 0) + int(b)
    compiled_b: dict[tuple[str, tuple[str, ...] | None], int] = dict(
        summarize(colls, per_step=True)
    )
    # XLA:CPU emits an all-reduce and a slice for each reduce-scatter: compiled without
    # any, the plan's reduce-scatters are compared in the all-reduce rows (the bytes of
    # the full-size side are the same), not as a row that compiled to nothing beside an
    # all-reduce row thousands of times its prediction
    folded = not any(k[0] == "reduce-scatter" for k in compiled_b) and any(
        k[0] == "reduce-scatter" for k in predicted
    )
    if folded:
        for k in [k for k in predicted if k[0] == "reduce-scatter"]:
            into = ("all-reduce", k[1])
            predicted[into] = predicted.get(into, 0) + predicted.pop(k)
    keys = sorted(set(predicted) | set(compiled_b), key=lambda k: (k[0], k[1] is None, k[1] or ()))
    rows = []
    for k in keys:
        p, c = predicted.get(k), compiled_b.get(k)
        axes = ",".join(k[1]) if k[1] is not None else "(no mesh axes)"
        ratio = f"{c / p:.2f}x" if p and c is not None else ""
        rows.append(
            (
                k[0],
                axes,
                format_bytes(p) if p is not None else "-",
                format_bytes(c) if c is not None else "-",
                ratio,
            )
        )
    print(
        "\ncommunication per step (bytes per device of each collective's full-size side; "
        "a loop's collectives every time it runs them):"
    )
    head = ("collective", "mesh axes", "predicted", "compiled", "compiled/predicted")
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)
    ]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if not rows:
        print("  (no collectives predicted or compiled)")
    total_p, total_c = sum(predicted.values()), sum(compiled_b.values())
    print(
        f"  total: predicted {format_bytes(total_p)}, compiled {format_bytes(total_c)} "
        f"in {len(colls)} collectives ({sum(c.in_loop for c in colls)} of them inside loops, "
        f"run {sum(c.runs for c in colls if c.in_loop)} times a step)"
    )
    by_axes: dict[str, list[int]] = {}
    for (_, axes), b in predicted.items():
        by_axes.setdefault(",".join(axes), [0, 0])[0] += b
    for (_, axes), b in compiled_b.items():
        by_axes.setdefault(",".join(axes) if axes is not None else "?", [0, 0])[1] += b
    print(
        "  by mesh axes (predicted -> compiled): "
        + ", ".join(
            f"{a or '-'} {format_bytes(p)} -> {format_bytes(c)}"
            for a, (p, c) in sorted(by_axes.items())
        )
    )
    if folded:
        print(
            "  note: XLA's CPU compiler emits an all-reduce (then a slice) where the plan has a "
            "reduce-scatter: the plan's reduce-scatters are counted in the all-reduce rows."
        )


def print_memory(plan: Plan, ma) -> None:
    """The predicted peak memory per device against XLA's memory analysis `ma`."""
    print("\nmemory per device:")
    if ma is None:
        print("  (the compiler reports no memory analysis on this platform)")
        return
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    temp, alias = int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes)
    total = arg + out + temp - alias
    c = plan.cost
    print(
        f"  predicted peak     {format_bytes(c.peak_memory_bytes)} (arguments {format_bytes(c.argument_bytes)})"
    )
    print(
        f"  compiled           {format_bytes(total)} = arguments {format_bytes(arg)} + outputs {format_bytes(out)} "
        f"+ temporaries {format_bytes(temp)} - aliased (donated) {format_bytes(alias)}"
    )
    if c.peak_memory_bytes:
        print(f"  compiled/predicted {total / c.peak_memory_bytes:.2f}x")


def verify_numerics(wl, mesh: dict[str, int], plan_path: str) -> int:
    """Run the planned program and `jax.jit` (`nnx.jit` for a step of NNX modules) on
    the workload's concrete arguments: their outputs, and the state an NNX step writes
    back into its modules, compared."""
    import copy

    import jax

    from autopar.api import parallelize
    from autopar.frontends import graph_nodes

    if wl.make_args is not None:
        args = wl.make_args(0)
    elif not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(wl.args)):
        args = wl.args
    else:
        raise UsageError(
            "--numerics runs the step, and the TARGET's Workload has abstract arguments "
            "(jax.ShapeDtypeStruct): give it concrete arrays as args, or "
            "make_args=lambda seed: (...) that makes them"
        )
    ref_args, par_args = copy.deepcopy(args), copy.deepcopy(args)
    nodes = bool(graph_nodes(args))
    if nodes:  # the step updates its modules in place, as nnx.jit runs it
        from flax import nnx

        jit = nnx.jit(wl.fn, static_argnums=wl.static_argnums)
    else:
        jit = jax.jit(wl.fn, static_argnums=wl.static_argnums)
    ref = _leaves(jit(*ref_args), "output")
    n_out, ref = len(ref), ref + _state_leaves(ref_args)
    # No donation here: the reference and the sharded run read the same arguments.
    step = parallelize(wl.fn, mesh=mesh, plan=plan_path, static_argnums=wl.static_argnums)
    got = _leaves(step(*par_args), "output") + _state_leaves(par_args)
    what = "outputs and state arrays written back" if nodes else "outputs"
    rc = _compare(got, ref, what, n_out)
    drawn = [w for w in step.plan(*args).warnings if "drawn per micro-batch" in w]
    if rc and drawn:
        print(
            "  (the plan draws its random numbers per micro-batch, as its warning says: "
            "dropout masks differ from jax.jit's; set the dropout rate to 0 to compare)"
        )
    return rc


def _leaves(tree, name: str) -> list[tuple[str, Any]]:
    """`tree`'s arrays named `name` and their paths, PRNG keys as their words."""
    import jax

    return [
        (
            f"{name}{jax.tree_util.keystr(path)}",
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        )
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if hasattr(x, "dtype")
    ]


def _state_leaves(args) -> list[tuple[str, Any]]:
    """The arrays of every NNX module (graph node) among `args`, after the step."""
    from autopar.frontends import graph_nodes

    nodes = graph_nodes(args)
    if not nodes:
        return []
    from flax import nnx

    many = len(nodes) > 1
    return [
        x
        for i, n in enumerate(nodes)
        for x in _leaves(nnx.state(n), type(n).__name__ + (f"#{i}" if many else ""))
    ]


def _compare(got: list, ref: list, what: str, n_out: int) -> int:
    """`got` against `ref` ((name, array) each): every float scalar within
    `NUMERICS_RTOL` (the first `n_out`, the step's outputs, printed; the state's where
    they differ), the floating arrays together within `NUMERICS_GLOBAL_RTOL` (relative
    L2), and integer arrays (PRNG keys' words, counters) equal: a returned key's words,
    ~1e9 each, would otherwise swamp the floats' sum."""
    import numpy as np

    num = den = 0.0
    worst, ok, floats, exact = (0.0, ""), True, 0, 0
    print("\nnumerics (the planned program vs jax.jit on the workload's arguments):")
    for k, ((name, a), (_, b)) in enumerate(zip(got, ref)):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not np.issubdtype(np.asarray(b).dtype, np.inexact):
            exact += 1
            if not np.array_equal(a64, b64):
                ok = False
                print(f"  {name}: {a64.ravel()[:4]} vs {b64.ravel()[:4]} MISMATCH (not equal)")
            continue
        floats += 1
        d = float(np.max(np.abs(a64 - b64))) if a64.size else 0.0
        num += float(np.sum((a64 - b64) ** 2))
        den += float(np.sum(b64**2))
        worst = max(worst, (d, name))
        if a64.ndim == 0:
            same = bool(np.allclose(a64, b64, rtol=NUMERICS_RTOL, atol=0))
            ok &= same
            if k < n_out or not same:
                verdict = "ok" if same else "MISMATCH"
                print(f"  {name}: {float(a64):.8g} vs {float(b64):.8g} {verdict}")
    rel = (num**0.5) / (den**0.5) if den else num**0.5
    floats_ok = rel <= NUMERICS_GLOBAL_RTOL
    ok = ok and floats_ok and len(got) == len(ref)
    print(
        f"  all {len(ref)} {what}: {floats} floating, relative L2 error {rel:.2e} (limit "
        f"{NUMERICS_GLOBAL_RTOL:g}), largest |difference| {worst[0]:.2e} ({worst[1] or '-'})"
        + (f"; {exact} integer (PRNG keys, counters) compared for equality" if exact else "")
        + f": {'MATCH' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1
