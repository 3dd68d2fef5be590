"""Reading plans: the reports behind `autopar inspect`, `autopar diff` and `autopar explain`.

Everything here works on a `Plan` alone (loaded from its JSON file, no function
needed), except `explain_alternatives`, which rebuilds the search problem from the
traced function to price every strategy the op could have had.

Reports are built as plain data first (`Table`s and JSON-able dicts) and rendered
afterwards as text, Markdown or HTML, so every format shows the same thing.
"""

from __future__ import annotations

import html
import linecache
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import PlanError, format_bytes
from autopar.ir.ops import CONTRACTIONS
from autopar.plan.plan import OpRecord, Plan, TensorRecord
from autopar.sharding import MeshInfo, Spec

# Path components that hold a model's arrays rather than name a part of the model.
_CONTAINERS = {"params", "opt_state", "batch_stats", "mu", "nu", "count", "state", "inner_state"}
_LAYER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)*?_?\d+$")
_PICTURE_CELLS = 16


# ---------------------------------------------------------------------------- formatting


def format_seconds(s: float) -> str:
    """`0.00123` -> `1.23 ms`: three significant digits in s, ms, µs or ns."""
    a = abs(s)
    if a == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if a >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def format_delta_seconds(d: float) -> str:
    return ("+" if d > 0 else "") + format_seconds(d) if d else "="


def format_delta_bytes(d: float) -> str:
    return ("+" if d > 0 else "-") + format_bytes(abs(d)) if d else "="


def _pct(a: float, b: float) -> str:
    if a == 0:
        return "" if b == 0 else "(new)"
    return f"({(b - a) / a * 100:+.1f}%)"


def itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        import jax.numpy as jnp

        return jnp.dtype(dtype).itemsize


def comm_key(key: str) -> tuple[str, tuple[str, ...]]:
    """`"all-reduce@data,model"` -> `("all-reduce", ("data", "model"))`."""
    kind, _, axes = key.partition("@")
    return kind, tuple(a for a in axes.split(",") if a)


# ---------------------------------------------------------------------------- grouping


def layer_of_path(path: str) -> str:
    """The part of the model an argument belongs to: `state/params/h_3/attn/q/kernel` ->
    `h_3`, `state/opt_state/0/mu/wte/embedding` -> `wte`; arrays outside params /
    optimizer state group under their argument's name (`batch/inputs` -> `batch`)."""
    parts = path.split("/")
    if not any(p in ("params", "opt_state", "batch_stats") for p in parts):
        return parts[0]
    rest = [p for p in parts[1:] if p not in _CONTAINERS and not p.isdigit()]
    for p in rest[:-1]:
        if _LAYER_RE.match(p):
            return p
    if rest:
        return rest[0]
    return "(optimizer)" if "opt_state" in parts else "(other)"


def layer_of_op(key: str) -> str:
    """The layer an op key's name stack names: `transpose(jvp(GPT))/h_0/mlp/c_fc/dot_general#1`
    -> `h_0`, `jvp(GPT)/wte.attend/dot_general#0` -> `wte`. Ops outside every module
    (the loss under `jvp()`, the optimizer with no name stack) -> `(top level)`."""
    stack = key.split("/")[:-1]
    wrapped = [p for p in stack if "(" in p]
    inner = re.sub(r"^.*\(|\).*$", "", wrapped[0]) if wrapped else None
    parts = [p.split(".", 1)[0] for p in stack if "(" not in p and not p.startswith("_")]
    for p in parts:
        if _LAYER_RE.match(p):
            return p
    if parts and inner != "":
        return parts[0]
    return inner or "(top level)"


def phase_of_op(key: str) -> str:
    """`forward`, `backward` (under a `transpose(...)` name stack) or `other`."""
    head = key.split("/", 1)[0]
    if head.startswith("transpose("):
        return "backward"
    if "/" in key and "(" in head:
        return "forward"
    return "other"


# ---------------------------------------------------------------------------- pictures


def split_picture(shape: Sequence[int], spec: Spec, mesh: MeshInfo) -> str:
    """One bar per dimension: `█` for a dimension every device holds whole, else one cell
    per shard with this device's shard `▓` and the others `░` (at most 16 cells; more
    shards than that print as `▓░…░/256`). `R S[model]` on a 4-way model axis:
    `█ ▓░░░`."""
    if not shape:
        return "·"
    bars = []
    for d in spec.dims[: len(shape)]:
        k = math.prod(mesh.size(a) for a in d) if d else 1
        if k <= 1:
            bars.append("█")
        elif k <= _PICTURE_CELLS:
            bars.append("▓" + "░" * (k - 1))
        else:
            bars.append("▓" + "░" * (_PICTURE_CELLS - 3) + f"…/{k}")
    return " ".join(bars)


def spec_text(spec: Spec) -> str:
    return str(spec)


def local_shape(r: TensorRecord, mesh: MeshInfo) -> tuple[int, ...]:
    return r.spec.local_shape(r.shape, mesh)


def local_bytes(r: TensorRecord, mesh: MeshInfo) -> int:
    return math.prod(local_shape(r, mesh)) * itemsize(r.dtype)


def full_bytes(r: TensorRecord) -> int:
    return math.prod(r.shape) * itemsize(r.dtype)


def shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


# ---------------------------------------------------------------------------- tables


@dataclass
class Table:
    """A titled table; rows may carry a group label (printed as a sub-header)."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    groups: list[str] | None = None
    right: tuple[int, ...] = ()  # right-aligned column indices
    notes: list[str] = field(default_factory=list)


def render(header: Sequence[str], tables: Iterable[Table], fmt: str) -> str:
    tables = list(tables)
    if fmt == "table":
        return _render_text(header, tables)
    if fmt == "markdown":
        return _render_markdown(header, tables)
    if fmt == "html":
        return _render_html(header, tables)
    raise ValueError(f"unknown format {fmt!r}")


def _render_text(header: Sequence[str], tables: list[Table]) -> str:
    out = list(header)
    for t in tables:
        out += ["", f"== {t.title} " + "=" * max(0, 74 - len(t.title))]
        if t.rows:
            widths = [max(len(c), *(len(r[i]) for r in t.rows)) for i, c in enumerate(t.columns)]

            def line(cells, widths=widths, t=t):
                return (
                    "  "
                    + "  ".join(
                        c.rjust(w) if i in t.right else c.ljust(w)
                        for i, (c, w) in enumerate(zip(cells, widths))
                    ).rstrip()
                )

            out.append(line(t.columns))
            out.append("  " + "  ".join("-" * w for w in widths))
            group = None
            for i, r in enumerate(t.rows):
                if t.groups is not None and t.groups[i] != group:
                    group = t.groups[i]
                    out.append(f"  [{group}]")
                out.append(line(r))
        else:
            out.append("  (none)")
        out += [f"  {n}" for n in t.notes]
    return "\n".join(out)


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def _render_markdown(header: Sequence[str], tables: list[Table]) -> str:
    out = []
    if header:
        out += [f"# {header[0]}", ""] + [f"    {h}" for h in header[1:]]
    for t in tables:
        out += ["", f"## {t.title}", ""]
        cols = (["group"] if t.groups is not None else []) + t.columns
        right = {i + (t.groups is not None) for i in t.right}
        if t.rows:
            out.append("| " + " | ".join(_md(c) for c in cols) + " |")
            out.append(
                "|" + "|".join("---:" if i in right else "---" for i in range(len(cols))) + "|"
            )
            for i, r in enumerate(t.rows):
                cells = ([t.groups[i]] if t.groups is not None else []) + r
                out.append("| " + " | ".join(_md(c) for c in cells) + " |")
        else:
            out.append("(none)")
        if t.notes:
            out.append("")
            out += [f"{n}  " for n in t.notes]
    return "\n".join(out) + "\n"


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em}"
    "table{border-collapse:collapse;margin-bottom:1em}"
    "td,th{border:1px solid #ccc;padding:2px 6px;font-family:monospace;white-space:pre}"
    "th{background:#eee}tr.group th{background:#dde8f5;text-align:left}td.r{text-align:right}"
)


def _render_html(header: Sequence[str], tables: list[Table]) -> str:
    e = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"><title>autopar plan</title>',
        f"<style>{_CSS}</style></head><body>",
    ]
    if header:
        out.append(f"<h1>{e(header[0])}</h1>")
        out += [f"<pre>{e(h)}</pre>" for h in header[1:]]
    for t in tables:
        out.append(f"<h2>{e(t.title)}</h2>")
        if not t.rows:
            out.append("<p>(none)</p>")
        else:
            out.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in t.columns) + "</tr>")
            group = None
            for i, r in enumerate(t.rows):
                if t.groups is not None and t.groups[i] != group:
                    group = t.groups[i]
                    out.append(
                        f'<tr class="group"><th colspan="{len(t.columns)}">{e(group)}</th></tr>'
                    )
                out.append(
                    "<tr>"
                    + "".join(
                        f'<td class="r">{e(c)}</td>' if j in t.right else f"<td>{e(c)}</td>"
                        for j, c in enumerate(r)
                    )
                    + "</tr>"
                )
            out.append("</table>")
        out += [f"<p>{e(n)}</p>" for n in t.notes]
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- inspect


def header_lines(plan: Plan) -> list[str]:
    mesh = " x ".join(f"{a}={s}" for a, s in zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    return [
        f"autopar plan for {plan.function or 'function'}",
        f"mesh {mesh} ({plan.mesh.num_devices} devices), cluster {plan.cluster.get('name', '?')}, "
        f"engine {plan.engine}"
        + (f" ({plan.search_seconds:.2f} s)" if plan.search_seconds else "")
        + f", fingerprint {plan.fingerprint}",
    ]


def _link(plan: Plan, axes: tuple[str, ...]) -> str:
    try:
        return "intra-node" if plan.mesh.is_intra_node(axes) else "inter-node"
    except (ValueError, IndexError):
        return "?"


def comm_breakdown(plan: Plan) -> dict:
    """Bytes moved per step by collective, by mesh axes and by kind."""
    by_coll, by_axes, by_kind = [], {}, {}
    total = sum(plan.cost.comm_bytes.values())
    for key, b in sorted(plan.cost.comm_bytes.items(), key=lambda kv: (-kv[1], kv[0])):
        kind, axes = comm_key(key)
        name = ",".join(axes)
        by_coll.append(
            {"kind": kind, "axes": list(axes), "link": _link(plan, axes), "bytes": int(b)}
        )
        by_axes[name] = by_axes.get(name, 0) + int(b)
        by_kind[kind] = by_kind.get(kind, 0) + int(b)
    return {
        "total_bytes": int(total),
        "collectives": by_coll,
        "by_axes": by_axes,
        "by_kind": by_kind,
    }


def layer_rows(plan: Plan) -> list[dict]:
    rows: dict[str, dict] = {}

    def row(name):
        return rows.setdefault(
            name,
            {
                "layer": name,
                "arrays": 0,
                "sharded_arrays": 0,
                "bytes": 0,
                "local_bytes": 0,
                "ops": 0,
                "compute_s": 0.0,
                "contraction_strategies": {},
            },
        )

    for r in plan.inputs:
        d = row(layer_of_path(r.path))
        d["arrays"] += 1
        d["sharded_arrays"] += bool(r.spec.used_axes)
        d["bytes"] += full_bytes(r)
        d["local_bytes"] += local_bytes(r, plan.mesh)
    for o in plan.ops:
        d = row(layer_of_op(o.key))
        d["ops"] += 1
        d["compute_s"] += o.compute_s
        if o.op in CONTRACTIONS:
            c = d["contraction_strategies"]
            c[o.strategy] = c.get(o.strategy, 0) + 1
    return list(rows.values())


def input_rows(plan: Plan) -> list[dict]:
    out = []
    for r in plan.inputs:
        shards = r.spec.shards(plan.mesh)
        out.append(
            {
                "path": r.path,
                "layer": layer_of_path(r.path),
                "shape": list(r.shape),
                "dtype": r.dtype,
                "spec": r.spec.to_json(),
                "strategy": str(r.spec),
                "local_shape": list(local_shape(r, plan.mesh)),
                "bytes": full_bytes(r),
                "local_bytes": local_bytes(r, plan.mesh),
                "fraction": f"1/{shards}" if shards > 1 else "all",
                "picture": split_picture(r.shape, r.spec, plan.mesh),
            }
        )
    return out


def op_rows(plan: Plan) -> list[dict]:
    return [
        {
            "key": o.key,
            "layer": layer_of_op(o.key),
            "phase": phase_of_op(o.key),
            "op": o.op,
            "source": o.source,
            "strategy": o.strategy,
            "compute_s": o.compute_s,
        }
        for o in plan.ops
    ]


def inspect_summary(plan: Plan, by: str = "param") -> dict:
    """JSON-able report: cost, communication, memory, candidates, layers, warnings, and
    the `by` view (`inputs` for param, `ops` for op; `layers` is always there)."""
    c = plan.cost
    hbm = float(plan.cluster.get("hbm_bytes", 0) or 0)
    inputs = input_rows(plan)
    out = {
        "function": plan.function,
        "fingerprint": plan.fingerprint,
        "mesh": plan.mesh.shape,
        "devices": plan.mesh.num_devices,
        "cluster": plan.cluster.get("name", "?"),
        "engine": plan.engine,
        "search_seconds": plan.search_seconds,
        "cost": {
            "compute_s": c.compute_s,
            "comm_s": c.comm_s,
            "step_s": c.step_s,
        },
        "communication": comm_breakdown(plan),
        "memory": {
            "peak_bytes": c.peak_memory_bytes,
            "argument_bytes": c.argument_bytes,
            "compiled_bytes": getattr(plan, "compiled_memory_bytes", None),
            "hbm_bytes": hbm,
            "peak_fraction_of_hbm": c.peak_memory_bytes / hbm if hbm else None,
            "input_bytes_total": sum(r["bytes"] for r in inputs),
            "input_bytes_per_device": sum(r["local_bytes"] for r in inputs),
        },
        "candidates": {
            k: {
                "compute_s": v.compute_s,
                "comm_s": v.comm_s,
                "step_s": v.step_s,
                "peak_memory_bytes": v.peak_memory_bytes,
                "chosen": k == plan.engine,
            }
            for k, v in plan.candidates.items()
        },
        "counts": {
            "inputs": len(plan.inputs),
            "sharded_inputs": sum(bool(r.spec.used_axes) for r in plan.inputs),
            "outputs": len(plan.outputs),
            "ops": len(plan.ops),
            "ops_by_primitive": dict(sorted(Counter(o.op for o in plan.ops).items())),
        },
        "layers": layer_rows(plan),
        "warnings": list(plan.warnings),
        "by": by,
    }
    if by == "param":
        out["inputs"] = inputs
    elif by == "op":
        out["ops"] = op_rows(plan)
    return out


def cost_tables(plan: Plan) -> list[Table]:
    c = plan.cost
    hbm = float(plan.cluster.get("hbm_bytes", 0) or 0)
    cost = Table("cost per step (predicted, no compute/communication overlap)", ["", "value"])
    cost.right = (1,)
    cost.rows = [
        ["compute", format_seconds(c.compute_s)],
        ["communication", format_seconds(c.comm_s)],
        ["step", format_seconds(c.step_s)],
        [
            "peak memory / device",
            format_bytes(c.peak_memory_bytes)
            + (
                f" ({c.peak_memory_bytes / hbm * 100:.1f}% of {format_bytes(hbm)} HBM)"
                if hbm
                else ""
            ),
        ],
        ["  of which arguments", format_bytes(c.argument_bytes)],
    ]
    compiled = getattr(plan, "compiled_memory_bytes", None)
    if compiled is not None:
        cost.rows.append(["memory compiled by XLA", format_bytes(compiled)])
    br = comm_breakdown(plan)
    total = br["total_bytes"] or 1
    comm = Table(
        "communication per step by collective (bytes per device)",
        ["collective", "mesh axes", "link", "bytes", "share"],
        right=(3, 4),
    )
    for d in br["collectives"]:
        comm.rows.append(
            [
                d["kind"],
                ",".join(d["axes"]) or "-",
                d["link"],
                format_bytes(d["bytes"]),
                f"{d['bytes'] / total * 100:.1f}%",
            ]
        )
    if br["collectives"]:
        comm.notes.append(
            "by mesh axes: "
            + ", ".join(f"{a or '-'} {format_bytes(b)}" for a, b in br["by_axes"].items())
        )
        comm.notes.append(
            "by kind: " + ", ".join(f"{k} {format_bytes(b)}" for k, b in br["by_kind"].items())
        )
    cands = Table(
        "candidates (the engines tried; the fastest that fits the memory budget wins)",
        ["engine", "step", "compute", "communication", "peak memory", ""],
        right=(1, 2, 3, 4),
    )
    for k, v in plan.candidates.items():
        cands.rows.append(
            [
                k,
                format_seconds(v.step_s),
                format_seconds(v.compute_s),
                format_seconds(v.comm_s),
                format_bytes(v.peak_memory_bytes),
                "<- chosen" if k == plan.engine else "",
            ]
        )
    return [cost, comm, cands]


def inspect_tables(plan: Plan, by: str = "param") -> list[Table]:
    tables = cost_tables(plan)
    if by == "param":
        rows = sorted(
            input_rows(plan),
            key=lambda r: (_layer_order(r["layer"]), _kind_order(r["path"]), r["path"]),
        )
        t = Table(
            f"inputs by layer ({sum(bool(r.spec.used_axes) for r in plan.inputs)} of "
            f"{len(plan.inputs)} sharded)",
            ["path", "dtype", "shape", "spec", "per device", "split"],
            groups=[r["layer"] for r in rows],
        )
        t.rows = [
            [
                r["path"],
                r["dtype"],
                shape_text(r["shape"]),
                r["strategy"],
                shape_text(r["local_shape"]),
                r["picture"],
            ]
            for r in rows
        ]
        t.notes.append(
            "split: one bar per dimension; █ = every device holds it whole, "
            "▓░░░ = split 4 ways (▓ is one device's share). R = replicated, S[axes] = sharded."
        )
        tables.append(t)
    elif by == "layer":
        t = Table(
            "layers",
            [
                "layer",
                "arrays",
                "sharded",
                "bytes",
                "per device",
                "ops",
                "compute",
                "most common contraction strategy",
            ],
            right=(1, 2, 3, 4, 5, 6),
        )
        for d in sorted(layer_rows(plan), key=lambda d: _layer_order(d["layer"])):
            cs = d["contraction_strategies"]
            top = max(cs.items(), key=lambda kv: kv[1]) if cs else None
            t.rows.append(
                [
                    d["layer"],
                    str(d["arrays"]),
                    str(d["sharded_arrays"]),
                    format_bytes(d["bytes"]),
                    format_bytes(d["local_bytes"]),
                    str(d["ops"]),
                    format_seconds(d["compute_s"]),
                    f"{top[0]} ({top[1]} of {sum(cs.values())})" if top else "",
                ]
            )
        tables.append(t)
    elif by == "op":
        rows = op_rows(plan)
        order = sorted(range(len(rows)), key=lambda i: (_layer_order(rows[i]["layer"]), i))
        t = Table(
            f"ops by layer ({len(rows)})",
            ["key", "phase", "source", "strategy", "compute"],
            groups=[rows[i]["layer"] for i in order],
            right=(4,),
        )
        t.rows = [
            [
                rows[i]["key"],
                rows[i]["phase"],
                rows[i]["source"],
                rows[i]["strategy"],
                format_seconds(rows[i]["compute_s"]),
            ]
            for i in order
        ]
        tables.append(t)
    else:
        raise ValueError(f"unknown view {by!r}; choose param, op or layer")
    tables.append(Table("warnings", ["warning"], rows=[[w] for w in plan.warnings]))
    return tables


def _kind_order(path: str) -> int:
    """Parameters first, then optimizer state, then everything else."""
    parts = path.split("/")
    return 0 if "params" in parts else 1 if "opt_state" in parts else 2


def _layer_order(name: str):
    """Sort `h_2` before `h_10`; the rest alphabetically, `(top level)` last."""
    m = re.match(r"^(.*?)(\d+)$", name)
    if name.startswith("("):
        return (2, name, 0)
    if m:
        return (0, m.group(1), int(m.group(2)))
    return (1, name, 0)


def render_inspect(plan: Plan, fmt: str = "table", by: str = "param") -> str:
    import json

    if fmt == "json":
        return json.dumps(
            {"plan": plan.to_json(), "summary": inspect_summary(plan, by)},
            indent=1,
            sort_keys=True,
            ensure_ascii=False,
        )
    return render(header_lines(plan), inspect_tables(plan, by), fmt)


# ---------------------------------------------------------------------------- diff


def _records(rs: Iterable[TensorRecord]) -> dict[str, TensorRecord]:
    return {r.path: r for r in rs}


def diff_plans(a: Plan, b: Plan) -> dict:
    """What changed from plan `a` to plan `b`: context, costs, inputs, outputs, ops."""
    ctx = {}
    for name, va, vb in (
        ("function", a.function, b.function),
        ("fingerprint", a.fingerprint, b.fingerprint),
        ("mesh", a.mesh.shape, b.mesh.shape),
        ("cluster", a.cluster.get("name"), b.cluster.get("name")),
        ("engine", a.engine, b.engine),
    ):
        ctx[name] = {"a": va, "b": vb, "same": va == vb}
    cost = {}
    for name in ("compute_s", "comm_s", "step_s", "peak_memory_bytes", "argument_bytes"):
        va, vb = getattr(a.cost, name), getattr(b.cost, name)
        cost[name] = {"a": va, "b": vb, "delta": vb - va}
    comm = {}
    for k in sorted(set(a.cost.comm_bytes) | set(b.cost.comm_bytes)):
        va, vb = a.cost.comm_bytes.get(k, 0), b.cost.comm_bytes.get(k, 0)
        if va != vb:
            comm[k] = {"a": va, "b": vb, "delta": vb - va}

    def tensors(ra, rb):
        ma, mb = _records(ra), _records(rb)
        changed, only_a, only_b = [], [p for p in ma if p not in mb], [p for p in mb if p not in ma]
        for p, x in ma.items():
            y = mb.get(p)
            if y is None:
                continue
            if (x.shape, x.dtype) != (y.shape, y.dtype) or x.spec != y.spec:
                changed.append(
                    {
                        "path": p,
                        "layer": layer_of_path(p),
                        "a": f"{x.dtype}{shape_text(x.shape)} {x.spec}",
                        "b": f"{y.dtype}{shape_text(y.shape)} {y.spec}",
                        "a_local_bytes": local_bytes(x, a.mesh),
                        "b_local_bytes": local_bytes(y, b.mesh),
                    }
                )
        return {"changed": changed, "only_a": only_a, "only_b": only_b}

    oa, ob = {o.key: o for o in a.ops}, {o.key: o for o in b.ops}
    ops_changed = []
    for k, x in oa.items():
        y = ob.get(k)
        if y is None:
            continue
        if (x.strategy, x.in_specs, x.out_specs) != (y.strategy, y.in_specs, y.out_specs):
            ops_changed.append(
                {
                    "key": k,
                    "layer": layer_of_op(k),
                    "op": x.op,
                    "source": x.source,
                    "a": x.strategy,
                    "b": y.strategy,
                    "compute_delta_s": y.compute_s - x.compute_s,
                }
            )
    return {
        "context": ctx,
        "cost": cost,
        "comm_bytes": comm,
        "inputs": tensors(a.inputs, b.inputs),
        "outputs": tensors(a.outputs, b.outputs),
        "ops": {
            "changed": ops_changed,
            "only_a": [k for k in oa if k not in ob],
            "only_b": [k for k in ob if k not in oa],
            "unchanged": sum(1 for k in oa if k in ob) - len(ops_changed),
        },
        "warnings": {
            "only_a": [w for w in a.warnings if w not in b.warnings],
            "only_b": [w for w in b.warnings if w not in a.warnings],
        },
    }


def render_diff(d: dict, name_a: str, name_b: str, fmt: str = "table") -> str:
    import json

    if fmt == "json":
        return json.dumps(d, indent=1, sort_keys=True, ensure_ascii=False)
    header = [f"autopar diff: a = {name_a}, b = {name_b}"]
    for k, v in d["context"].items():
        header.append(f"{k}: {v['a']}" if v["same"] else f"{k}: {v['a']} -> {v['b']}  (differs)")
    tables = []
    cost = Table("cost (b - a)", ["", "a", "b", "delta"], right=(1, 2, 3))
    for k, v in d["cost"].items():
        if k.endswith("_s"):
            row = [format_seconds(v["a"]), format_seconds(v["b"]), format_delta_seconds(v["delta"])]
        else:
            row = [format_bytes(v["a"]), format_bytes(v["b"]), format_delta_bytes(v["delta"])]
        row[-1] += f" {_pct(v['a'], v['b'])}" if v["delta"] else ""
        cost.rows.append([k.removesuffix("_s").removesuffix("_bytes").replace("_", " "), *row])
    for k, v in d["comm_bytes"].items():
        cost.rows.append(
            [
                k,
                format_bytes(v["a"]),
                format_bytes(v["b"]),
                f"{format_delta_bytes(v['delta'])} {_pct(v['a'], v['b'])}",
            ]
        )
    tables.append(cost)
    for part in ("inputs", "outputs"):
        t = d[part]
        t = {
            **t,
            "changed": sorted(
                t["changed"],
                key=lambda c: (_layer_order(c["layer"]), _kind_order(c["path"]), c["path"]),
            ),
        }
        tab = Table(
            f"{part}: {len(t['changed'])} changed",
            ["path", "a", "b", "per device"],
            groups=[c["layer"] for c in t["changed"]],
            right=(3,),
        )
        tab.rows = [
            [
                c["path"],
                c["a"],
                c["b"],
                format_delta_bytes(c["b_local_bytes"] - c["a_local_bytes"]),
            ]
            for c in t["changed"]
        ]
        tab.notes += [f"only in a: {p}" for p in t["only_a"]]
        tab.notes += [f"only in b: {p}" for p in t["only_b"]]
        tables.append(tab)
    o = d["ops"]
    order = {c["key"]: i for i, c in enumerate(o["changed"])}
    o = {
        **o,
        "changed": sorted(o["changed"], key=lambda c: (_layer_order(c["layer"]), order[c["key"]])),
    }
    per_layer = Counter(c["layer"] for c in o["changed"])
    tab = Table(
        f"ops: {len(o['changed'])} changed, {o['unchanged']} unchanged",
        ["key", "source", "a", "b", "compute delta"],
        groups=[c["layer"] for c in o["changed"]],
        right=(4,),
    )
    tab.rows = [
        [c["key"], c["source"], c["a"], c["b"], format_delta_seconds(c["compute_delta_s"])]
        for c in o["changed"]
    ]
    if per_layer:
        tab.notes.append(
            "changed ops per layer: " + ", ".join(f"{k} {n}" for k, n in per_layer.items())
        )
    tab.notes += [f"only in a: {k}" for k in o["only_a"][:20]]
    tab.notes += [f"only in b: {k}" for k in o["only_b"][:20]]
    if len(o["only_a"]) > 20 or len(o["only_b"]) > 20:
        tab.notes.append(f"({len(o['only_a'])} ops only in a, {len(o['only_b'])} only in b)")
    tables.append(tab)
    w = d["warnings"]
    if w["only_a"] or w["only_b"]:
        tables.append(
            Table(
                "warnings",
                ["plan", "warning"],
                rows=[["a", x] for x in w["only_a"]] + [["b", x] for x in w["only_b"]],
            )
        )
    return render(header, tables, fmt)


# ---------------------------------------------------------------------------- explain

_SOURCE_RE = re.compile(r"^(?P<file>[^:]+\.py):(?P<line>\d+)$")


def find_ops(plan: Plan, query: str) -> list[int]:
    """Op indices for `query`: an exact op key; a source location `file.py:LINE` (every
    op it produced); else a substring of op keys (or of sources) that must be unique.
    Raises PlanError naming the candidates when nothing or too much matches."""
    keys = [o.key for o in plan.ops]
    if query in keys:
        return [keys.index(query)]
    if _SOURCE_RE.match(query):
        hits = [i for i, o in enumerate(plan.ops) if o.source == query]
        if not hits:
            hits = [i for i, o in enumerate(plan.ops) if o.source.endswith("/" + query)]
        if hits:
            return hits
    hits = [i for i, k in enumerate(keys) if query in k]
    if not hits:
        hits = [i for i, o in enumerate(plan.ops) if query in o.source]
    if len(hits) == 1:
        return hits
    if not hits:
        raise PlanError(
            f"no op matches {query!r}: give an op key (see `autopar inspect --by op`), "
            "a unique part of one, or a source location like gpt.py:99"
        )
    shown = ", ".join(keys[i] for i in hits[:8])
    raise PlanError(
        f"{query!r} matches {len(hits)} ops ({shown}{', ...' if len(hits) > 8 else ''}); "
        "give more of the key"
    )


def source_text(source: str, search_dirs: Sequence[str] = ()) -> str | None:
    """The text of `file.py:LINE`, found among loaded modules or in `search_dirs`."""
    m = _SOURCE_RE.match(source)
    if not m:
        return None
    base, line = os.path.basename(m.group("file")), int(m.group("line"))
    paths = []
    for d in search_dirs:
        p = os.path.join(d, base)
        if os.path.isfile(p):
            paths.append(os.path.abspath(p))
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and os.path.basename(f) == base:
            paths.append(os.path.abspath(f))
    paths = list(dict.fromkeys(paths))
    for p in paths:
        text = linecache.getline(p, line).strip()
        if text:
            more = f"  (one of {len(paths)} files named {base})" if len(paths) > 1 else ""
            return f"{p}:{line}: {text}{more}"
    return None


def explain_op(plan: Plan, i: int, search_dirs: Sequence[str] = (), graph=None) -> list[str]:
    """The op's record in words; with the traced `graph`, its operand and result types."""
    o: OpRecord = plan.ops[i]
    node = graph.nodes[i] if graph is not None and i < len(graph.nodes) else None
    types_in = [str(graph.values[v]) for v in node.inputs] if node is not None else []
    types_out = [str(graph.values[v]) for v in node.outputs] if node is not None else []
    lines = [
        f"op {o.key}",
        f"  primitive {o.op}, layer {layer_of_op(o.key)}, {phase_of_op(o.key)} pass",
        f"  source    {o.source}",
    ]
    text = source_text(o.source, search_dirs)
    if text:
        lines.append(f"            {text}")
    lines.append(f"  strategy  {o.strategy}")
    for j, s in enumerate(o.in_specs):
        t = f"{types_in[j]}  " if j < len(types_in) else ""
        lines.append(f"  in[{j}]     {t}{s}   {s.to_json()}")
    for j, s in enumerate(o.out_specs):
        t = f"{types_out[j]}  " if j < len(types_out) else ""
        lines.append(f"  out[{j}]    {t}{s}   {s.to_json()}")
    lines.append(f"  compute   {format_seconds(o.compute_s)}")
    return lines


@dataclass(frozen=True)
class Alternative:
    index: int
    name: str
    compute_s: float
    reshard_s: float
    memory_bytes: float
    chosen: bool
    worst: list[str]  # the costliest reshards against the neighbours, described

    @property
    def total_s(self) -> float:
        return self.compute_s + self.reshard_s


def plan_choice(problem, plan: Plan) -> tuple[list[int | None], list[str]]:
    """The plan's strategy index per cost-graph node of `problem` (None where the plan's
    strategy is not among those enumerated now), and notes about such mismatches."""
    notes = []
    choice: list[int | None] = []
    for r, strats in zip(plan.inputs, problem.strategies[: problem.num_inputs]):
        idx = next((k for k, s in enumerate(strats) if s.out_specs[0] == r.spec), None)
        choice.append(idx)
    for o, strats in zip(plan.ops, problem.strategies[problem.num_inputs :]):
        idx = next(
            (
                k
                for k, s in enumerate(strats)
                if s.name == o.strategy
                and tuple(s.in_specs) == o.in_specs
                and tuple(s.out_specs) == o.out_specs
            ),
            None,
        )
        if idx is None:
            idx = next((k for k, s in enumerate(strats) if s.name == o.strategy), None)
        choice.append(idx)
    missing = sum(c is None for c in choice)
    if missing:
        notes.append(
            f"{missing} nodes' planned strategies are not among the strategies enumerated now "
            "(the strategy rules changed since the plan was made?); their edges are left out"
        )
    return choice, notes


def _node_name(problem, plan: Plan, u: int) -> str:
    if u < problem.num_inputs:
        return plan.inputs[u].path
    return plan.ops[u - problem.num_inputs].key


def _edge_collectives(problem, choice, v: int, s: int) -> dict[int, list]:
    """Collectives on each edge of node v when v takes strategy s and its neighbours
    keep `choice`: neighbour cost-graph node -> [Collective]."""
    g, n_in = problem.graph, problem.num_inputs
    strats = problem.strategies
    out: dict[int, list] = {}
    if v >= n_in:
        node = g.nodes[v - n_in]
        for j, x in enumerate(node.inputs):
            if x not in problem.source:
                continue
            u, k = problem.source[x]
            if choice[u] is None:
                continue
            r = problem.cost.reshard(
                g.values[x], strats[u][choice[u]].out_specs[k], strats[v][s].in_specs[j]
            )
            out.setdefault(u, []).extend(r.collectives)
        outs = node.outputs
    else:
        outs = (g.inputs[v],)
    for k, x in enumerate(outs):
        for w in g.consumers.get(x, ()):
            cw = n_in + w
            if choice[cw] is None:
                continue
            for j, y in enumerate(g.nodes[w].inputs):
                if y == x:
                    r = problem.cost.reshard(
                        g.values[x], strats[v][s].out_specs[k], strats[cw][choice[cw]].in_specs[j]
                    )
                    out.setdefault(cw, []).extend(r.collectives)
    return out


def explain_alternatives(problem, plan: Plan, i: int) -> tuple[list[Alternative], list[str]]:
    """Every strategy op `i` could take, priced with the rest of the plan fixed: its
    compute time plus the resharding against its neighbours' chosen strategies (the
    cost-graph edges, as the engines see them). Sorted cheapest first."""
    from autopar.search.engines import _edge_sum, _tables

    choice, notes = plan_choice(problem, plan)
    v = problem.num_inputs + i
    nb = _tables(problem)
    decided = np.array([c is not None for c in choice])
    filled = [c if c is not None else 0 for c in choice]
    strats = problem.strategies[v]
    reshard = _edge_sum(nb[v], filled, decided, len(strats))
    alts = []
    for s, st in enumerate(strats):
        per_nb = {}
        for u, m in nb[v]:
            if decided[u]:
                per_nb[u] = per_nb.get(u, 0.0) + float(m[filled[u]][s])
        worst = []
        colls = _edge_collectives(problem, choice, v, s)
        for u, t in sorted(per_nb.items(), key=lambda kv: -kv[1])[:3]:
            if t <= 0:
                continue
            desc = ", ".join(
                f"{c.kind}@{','.join(c.axes)} {format_bytes(c.bytes)}" for c in colls.get(u, ())
            )
            worst.append(
                f"{format_seconds(t)} against {_node_name(problem, plan, u)}"
                + (f" ({desc})" if desc else "")
            )
        alts.append(
            Alternative(
                s,
                st.name,
                float(problem.node_time[v][s]),
                float(reshard[s]),
                float(problem.node_mem[v][s]),
                s == choice[v],
                worst,
            )
        )
    alts.sort(key=lambda a: (a.total_s, not a.chosen, a.index))
    if choice[v] is None:
        notes.append("the plan's strategy for this op is not among those enumerated now")
    return alts, notes


def render_alternatives(alts: list[Alternative], engine: str) -> list[str]:
    chosen = next((a for a in alts if a.chosen), None)
    lines = [
        f"  {len(alts)} strategies, priced with every other node as planned "
        "(compute + resharding against the neighbours' chosen strategies):",
    ]
    w = max((len(a.name) for a in alts), default=8)
    lines.append(
        f"    {'strategy':<{w}}  {'compute':>10}  {'reshard':>10}  {'total':>10}  {'memory':>10}"
    )
    for a in alts:
        mark = "  <- chosen" if a.chosen else ""
        lines.append(
            f"    {a.name:<{w}}  {format_seconds(a.compute_s):>10}  {format_seconds(a.reshard_s):>10}  "
            f"{format_seconds(a.total_s):>10}  {format_bytes(a.memory_bytes):>10}{mark}"
        )
    if chosen is None:
        return lines
    if chosen.worst:
        lines.append("  the chosen strategy pays:")
        lines += [f"        {w}" for w in chosen.worst]
    lines.append("  why the others lost:")
    for a in alts:
        if a.chosen:
            continue
        d = a.total_s - chosen.total_s
        dm = a.memory_bytes - chosen.memory_bytes
        mem = f"; output memory {format_delta_bytes(dm)}/device" if dm else ""
        if d > 0:
            parts = []
            if a.compute_s != chosen.compute_s:
                parts.append(f"compute {format_delta_seconds(a.compute_s - chosen.compute_s)}")
            if a.reshard_s != chosen.reshard_s:
                parts.append(f"resharding {format_delta_seconds(a.reshard_s - chosen.reshard_s)}")
            why = "; ".join(parts)
            lines.append(f"    {a.name}: {format_delta_seconds(d)} ({why}){mem}")
        else:
            lines.append(
                f"    {a.name}: {'as cheap' if d == 0 else f'cheaper by {format_seconds(-d)}'} here, "
                f"but engine {engine} chose for the whole graph (costs it moves elsewhere, "
                f"the memory budget, or pinned baselines){mem}"
            )
        for wline in a.worst:
            lines.append(f"        {wline}")
    return lines
