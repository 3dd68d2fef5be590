"""The `autopar` command line: plan offline, then read, compare, explain and check plans.

    autopar search TARGET --mesh data=8,model=8 [--cluster h100-sxm] [--engine auto]
                          [--memory-budget 80GB] [--out plan.json]
    autopar inspect plan.json [--format table|json|markdown|html] [--by param|op|layer]
    autopar diff a.json b.json [--format table|json|markdown|html]
    autopar explain plan.json OP [--target TARGET]
    autopar verify plan.json TARGET
    autopar render plan.json [--out plan.png|plan.svg|plan.pdf] [--top 8] [--title TEXT]
    autopar calibrate --out PROFILE.toml [--mesh data=2,model=4] [--quick]
    autopar demo [...]

TARGET names a factory returning an `autopar.Workload`: `path/to/file.py:factory` or
`package.module:factory`, optionally called with literal arguments
(`autopar/examples/examples.py:gpt(hidden=256, layers=4)`).

A mesh is `name=size,...` (`data=8,model=8`), `DxM[xE]` (`8x8` is data=8,model=8;
a third size is the `expert` axis) or a device count (`64`: mesh-shape search over 1-3 axes).

Plans are made on this machine on simulated CPU devices: like `autopar demo`,
`search` and `verify` set `XLA_FLAGS=--xla_force_host_platform_device_count=N`
before JAX starts its backend (unless XLA_FLAGS already sets a count) and run on
the CPU (unless JAX_PLATFORMS says otherwise). `search` asks for N = the mesh size
up to 64 devices, else 8 (larger meshes are planned on an abstract mesh);
`verify` compiles for the whole mesh, so it asks for the mesh size.

Bad input (a missing or corrupted plan, a bad TARGET or mesh, a plan that does not
match the function) exits with status 2 and a one-line message on stderr. Set
AUTOPAR_DEBUG=1 (or pass --debug) for the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time

from autopar.errors import AutoparError, UsageError, did_you_mean
from autopar.passes.pipeline import SCHEDULES
from autopar.tools.verify import one_line

PROG = "autopar"
THREE_AXES = ("data", "model", "expert")
DEFAULT_OUT = "plan.json"
MAX_SIMULATED = 64  # search: above this many devices, plan on an abstract mesh with 8 real ones
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
}


# ---------------------------------------------------------------------------- parsing


def parse_mesh(text: str) -> dict[str, int]:
    """`data=8,model=8` | `8x8` (data, model) | `2x2x2` (data, model, expert) | `64` (data)."""
    t = text.strip()
    if re.fullmatch(r"\d+", t):
        sizes = [int(t)]
    elif re.fullmatch(r"\d+(?:\s*[xX]\s*\d+)+", t):
        sizes = [int(s) for s in re.split(r"\s*[xX]\s*", t)]
        if len(sizes) > len(THREE_AXES):
            raise ValueError(
                f"bad mesh {text!r}: {len(sizes)} sizes, but DxMxE names at most "
                f"{len(THREE_AXES)} axes ({', '.join(THREE_AXES)}); name them: a=2,b=2,c=2,d=2"
            )
    elif "=" in t:
        from autopar.examples.demo import parse_mesh as parse_pairs

        mesh = parse_pairs(t)
        sizes = list(mesh.values())
        if math.prod(sizes) < 1:
            raise ValueError(f"bad mesh {text!r}: no devices")
        return mesh
    else:
        raise ValueError(
            f"bad mesh {text!r}: expected name=size pairs (data=8,model=8), "
            "sizes like 8x8 (axes data, model[, expert]) or a device count (64)"
        )
    if any(s < 1 for s in sizes):
        raise ValueError(f"bad mesh {text!r}: every axis size must be >= 1")
    return dict(zip(THREE_AXES if len(sizes) > 1 else ("data",), sizes))


def parse_argnums(text: str) -> tuple[int, ...]:
    """`0` or `0,2` -> (0,) / (0, 2); `none` -> ()."""
    if text.strip().lower() == "none":
        return ()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise UsageError(
            f"--donate {text!r}: positional argument numbers, e.g. 0 or 0,1 (none: no donation)"
        )
    return tuple(int(p) for p in parts)


def parse_bytes(text: str) -> float:
    """`80GB` (1e9), `80GiB` (2**30), `1.5e9`, `512MiB` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"bad memory budget {text!r}: expected a number of bytes with an optional unit, "
            "like 80GB, 80GiB, 512MiB or 1.5e9"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"bad memory budget {text!r}: must be positive")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit status 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="autopar: automatic parallelization for JAX. Search sharding plans "
        "offline, inspect, compare, explain and verify them.",
        epilog="`autopar demo [--mesh ...]` shards a small GPT over simulated CPU devices "
        "and checks its losses against jax.jit.",
    )
    p.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors"
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    s = sub.add_parser(
        "search",
        help="search a plan for TARGET on a mesh and write it as JSON",
        description="Trace TARGET's function on its abstract arguments, search a sharding "
        "for every op with the cost model of CLUSTER, and write the plan.",
    )
    s.add_argument(
        "target", metavar="TARGET", help="path/to/file.py:factory or package.module:factory"
    )
    s.add_argument(
        "--mesh",
        required=True,
        help="data=8,model=8 | 8x8 (data, model) | 2x2x2 (data, model, expert) | 64 (a device "
        "count: the mesh shape is searched too)",
    )
    s.add_argument(
        "--cluster",
        default="h100-sxm",
        help="bundled profile name or a .toml path (default: h100-sxm)",
    )
    s.add_argument(
        "--engine",
        default="auto",
        help="auto, recursive, dp, ilp, data, fsdp or propagate (default: auto)",
    )
    s.add_argument(
        "--memory-budget",
        metavar="BYTES",
        help="bytes per device, e.g. 80GB, 80GiB, 1.5e9 (default: the cluster's HBM)",
    )
    s.add_argument(
        "--pipeline-stages",
        metavar="S",
        help="pipeline the layer loops over the mesh's 'stage' axis of size S, or 'auto' "
        "(with --mesh a device count: try every stage count)",
    )
    s.add_argument("--microbatches", type=int, metavar="M", help="pipeline micro-batches")
    s.add_argument(
        "--pipeline-schedule",
        choices=SCHEDULES,
        help="pipeline schedule (default: 1f1b where the step allows it, else gpipe)",
    )
    s.add_argument(
        "--virtual-stages",
        type=int,
        metavar="V",
        help="layer chunks per stage for --pipeline-schedule interleaved (default 2)",
    )
    s.add_argument(
        "--grad-accumulation",
        type=int,
        metavar="M",
        help="accumulate gradients over M micro-batches",
    )
    s.add_argument(
        "--remat",
        choices=("none", "dots", "selective", "full", "auto"),
        help="rematerialize layer loops",
    )
    s.add_argument(
        "--precision",
        choices=("bf16", "fp16"),
        help="bf16 or fp16 (per-tensor scaled) compute, f32 master weights",
    )
    s.add_argument(
        "--donate",
        metavar="I,J",
        help="positional arguments the step donates (as donate_argnums=; the train state "
        "of a training loop: its update then needs no second copy), in place of the "
        "Workload's donate_argnums; none: nothing donated",
    )
    s.add_argument(
        "--out", "-o", default=DEFAULT_OUT, help=f"plan file to write (default: {DEFAULT_OUT})"
    )
    s.set_defaults(func=cmd_search)

    formats = ("table", "json", "markdown", "html")
    i = sub.add_parser(
        "inspect",
        help="show a plan: specs per parameter/op/layer, costs, candidates, warnings",
        description="Show a plan file: every input's sharding with a picture of the split, "
        "grouped by layer (or every op, or a per-layer summary), the cost breakdown "
        "(compute; communication by mesh axis and collective kind; memory), the candidates "
        "the search compared, and warnings.",
    )
    i.add_argument("plan", metavar="PLAN", help="plan file (autopar.plan/1 JSON)")
    i.add_argument("--format", "-f", choices=formats, default="table")
    i.add_argument("--by", choices=("param", "op", "layer"), default="param")
    i.set_defaults(func=cmd_inspect)

    d = sub.add_parser(
        "diff",
        help="compare two plans param by param and op by op, with cost deltas",
        description="What changed from plan A to plan B: costs, every input/output whose "
        "spec changed, every op (by op key) whose strategy changed.",
    )
    d.add_argument("a", metavar="A")
    d.add_argument("b", metavar="B")
    d.add_argument("--format", "-f", choices=formats, default="table")
    d.set_defaults(func=cmd_diff)

    e = sub.add_parser(
        "explain",
        help="why an op got its strategy",
        description="Show one op of a plan: source line, chosen strategy, in/out specs, "
        "compute time. With --target, rebuild the search problem from the function and "
        "price every alternative strategy against the chosen neighbours.",
    )
    e.add_argument("plan", metavar="PLAN")
    e.add_argument(
        "op", metavar="OP", help="op key, a unique part of one, or a source location like gpt.py:99"
    )
    e.add_argument("--target", help="the plan's TARGET, to price the alternatives")
    e.set_defaults(func=cmd_explain)

    v = sub.add_parser(
        "verify",
        help="compile TARGET with a plan and compare predicted and compiled communication/memory",
        description="Load PLAN for TARGET with autopar.parallelize, lower and compile it on "
        "the abstract arguments (on simulated CPU devices), and compare the plan's predicted "
        "collective bytes and memory with what XLA compiled. Exit 0 if it compiles.",
    )
    v.add_argument("plan", metavar="PLAN")
    v.add_argument("target", metavar="TARGET")
    v.add_argument(
        "--allow-partial",
        action="store_true",
        help="if PLAN was made for a different version of TARGET, keep the argument specs that "
        "still match and search the rest (the plan's warnings say what was reused)",
    )
    v.add_argument(
        "--numerics",
        action="store_true",
        help="also run the plan and jax.jit on the Workload's make_args(0) and compare the "
        "outputs (needs the mesh's devices; exit 1 on a mismatch)",
    )
    v.set_defaults(func=cmd_verify)

    r = sub.add_parser(
        "render",
        help="draw a plan: layers coloured by strategy, sharding grids of the largest parameters",
        description="Draw PLAN as a picture (matplotlib, Agg backend): the layers in program "
        "order (identical layers drawn once, `h_0..h_95 (96 identical)`), each coloured by its "
        "most common contraction strategy and by how its parameters are split, and the largest "
        "parameters as rectangles cut into one tile per shard along every sharded dimension.",
    )
    r.add_argument("plan", metavar="PLAN", help="plan file (autopar.plan/1 JSON)")
    r.add_argument(
        "--out",
        "-o",
        help="picture to write: .png, .svg or .pdf (default: PLAN with .png instead of .json)",
    )
    r.add_argument(
        "--top",
        type=int,
        default=8,
        help="how many of the largest parameters to draw (default: 8)",
    )
    r.add_argument("--title", help="the picture's title (default: the plan's function)")
    r.set_defaults(func=cmd_render)

    c = sub.add_parser(
        "calibrate",
        help="measure this machine's devices and write a cluster profile (.toml)",
        description="Microbenchmark the local devices: matmul FLOP/s per dtype, memory "
        "bandwidth, and all-reduce, all-gather, reduce-scatter and all-to-all over each mesh "
        "axis at several message sizes; fit latency and bandwidth per link tier and write "
        "them as a cluster profile that `--cluster PROFILE.toml` and cost_models.load accept.",
    )
    c.add_argument("--out", "-o", required=True, help="profile to write (.toml)")
    c.add_argument(
        "--mesh",
        help="mesh to run the collectives on (default: every device of JAX's default backend "
        "as data=N; a CPU gets 8 simulated devices, or the --mesh size, unless XLA_FLAGS sets "
        "a count)",
    )
    c.add_argument("--name", help="profile name (default: calibrated-<platform>-<device kind>)")
    c.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes and fewer repetitions (about 10 s on a 2-core CPU; the full run about 30 s)",
    )
    c.set_defaults(func=cmd_calibrate)

    sub.add_parser(
        "demo",
        help="shard a small GPT over simulated CPU devices and check it (see `autopar demo --help`)",
        add_help=False,
    )
    return p


# ---------------------------------------------------------------------------- helpers


def prepare_backend(num_devices: int) -> None:
    """Ask for `num_devices` simulated CPU devices before JAX's backend starts."""
    from autopar.examples import demo

    started = demo._backend_started()
    demo.setup_env(num_devices)
    import jax

    if "JAX_PLATFORMS" not in os.environ and not started:
        jax.config.update("jax_platforms", "cpu")


def prepare_search_backend(num_devices: int) -> None:
    """Simulated devices to plan for a `num_devices` mesh: all of them up to
    MAX_SIMULATED, else 8 (larger meshes are planned on an abstract mesh)."""
    prepare_backend(num_devices if num_devices <= MAX_SIMULATED else 8)


def _load_plan(path: str):
    from autopar.plan.plan import Plan

    return Plan.load(path)


# ---------------------------------------------------------------------------- commands


def cmd_search(args) -> int:
    mesh = parse_mesh(args.mesh)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    n = math.prod(mesh.values())
    prepare_search_backend(n)
    import cost_models

    profile = cost_models.load(args.cluster)
    from autopar.search import ENGINES

    if args.engine != "auto" and args.engine not in ENGINES:
        raise UsageError(
            f"unknown engine {args.engine!r}{did_you_mean(args.engine, ('auto', *ENGINES))}; "
            f"choose one of: auto, {', '.join(ENGINES)}"
        )
    from autopar.tools.workload import load_target

    wl = load_target(args.target)
    import autopar

    t0 = time.perf_counter()
    # A bare device count (`--mesh 64`) searches the mesh shape too.
    search_mesh = n if re.fullmatch(r"\s*\d+\s*", args.mesh) else mesh
    stages = args.pipeline_stages
    if stages is not None and stages != "auto":
        if not stages.isdigit():
            raise UsageError(f"--pipeline-stages {stages!r}: a stage count or 'auto'")
        stages = int(stages)
    donate = parse_argnums(args.donate) if args.donate else wl.donate_argnums
    step = autopar.parallelize(
        wl.fn,
        mesh=search_mesh,
        cluster=profile,
        engine=args.engine,
        memory_budget=budget,
        static_argnums=wl.static_argnums,
        donate_argnums=donate,
        pipeline_stages=stages,
        microbatches=args.microbatches,
        pipeline_schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages,
        grad_accumulation=args.grad_accumulation,
        remat=args.remat,
        precision=args.precision,
    )
    from autopar.compile.progress import Progress, enabled

    # shown once a search has run 1 s (AUTOPAR_PROGRESS_AFTER=seconds sets it), unless
    # AUTOPAR_PROGRESS=0
    after = float(os.environ.get("AUTOPAR_PROGRESS_AFTER", "1.0"))
    with Progress(show_after=after, prefix="") if enabled(None) else contextlib.nullcontext():
        plan = step.plan(*wl.args)
    seconds = time.perf_counter() - t0
    plan.save(args.out)
    import jax

    platform = jax.devices()[0].platform
    where = (
        f"{n} {'simulated ' if platform == 'cpu' else ''}{platform.upper()} devices"
        if isinstance(step.mesh, jax.sharding.Mesh)
        else f"an abstract {n}-device mesh ({len(jax.devices())} devices here)"
    )
    print(plan.summary())
    print(
        f"{wl.name or args.target}: {len(plan.inputs)} inputs, {len(plan.ops)} ops; "
        f"traced and searched in {seconds:.1f} s on {where}"
    )
    print(f"plan written to {args.out}")
    return 0


def cmd_inspect(args) -> int:
    from autopar.tools.inspect import render_inspect

    plan = _load_plan(args.plan)
    print(render_inspect(plan, args.format, args.by))
    return 0


def cmd_diff(args) -> int:
    from autopar.tools.inspect import diff_plans, render_diff

    a, b = _load_plan(args.a), _load_plan(args.b)
    print(
        render_diff(diff_plans(a, b), args.a, args.b, args.format),
        end="" if args.format in ("markdown", "html") else "\n",
    )
    return 0


def cmd_explain(args) -> int:
    from autopar.tools.inspect import explain

    plan = _load_plan(args.plan)
    explain(plan, args.plan, args.op, args.target, prepare_backend=prepare_search_backend)
    return 0


def cmd_verify(args) -> int:
    from autopar.tools.verify import verify

    plan = _load_plan(args.plan)
    return verify(
        plan,
        args.plan,
        args.target,
        allow_partial=args.allow_partial,
        numerics=args.numerics,
        prepare_backend=prepare_backend,
    )


def cmd_render(args) -> int:
    from autopar.tools.render import render_plan

    if args.top < 0:
        raise UsageError(f"--top must be >= 0, got {args.top}")
    out = args.out or (os.path.splitext(args.plan)[0] + ".png")
    plan = _load_plan(args.plan)
    t0 = time.perf_counter()
    path = render_plan(plan, out, top=args.top, title=args.title or "")
    print(f"picture of {args.plan} written to {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_calibrate(args) -> int:
    if not args.out.endswith(".toml"):
        raise UsageError(f"--out {args.out!r}: a cluster profile is a .toml file")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UsageError(f"cannot write {args.out}: directory {out_dir} does not exist")
    mesh = parse_mesh(args.mesh) if args.mesh else None
    # JAX's default backend (the GPUs when there are any; JAX_PLATFORMS=cpu for the CPU),
    # unlike search/verify, which plan on the CPU. A CPU gets simulated devices.
    from autopar.examples import demo

    demo.setup_env(math.prod(mesh.values()) if mesh else 8)
    from autopar.cost.calibrate import calibrate

    calibrate(args.out, mesh=mesh, quick=args.quick, name=args.name, log=print)
    return 0


COMMANDS = ("search", "inspect", "diff", "explain", "verify", "render", "calibrate", "demo")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "demo":
        from autopar.examples import demo

        return demo.main(argv[1:])
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a usage error, already printed
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    debug = args.debug or os.environ.get("AUTOPAR_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except BrokenPipeError:  # `autopar inspect plan.json | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (AutoparError, ValueError, OSError, ImportError) as e:
        if debug:
            raise
        print(f"{PROG} {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
