"""`autopar inspect`: a plan's costs, communication, memory, candidates, and its
inputs, ops or layers, as JSON-able data and as tables."""

from __future__ import annotations

import math
import re
from collections import Counter

from autopar.errors import format_bytes
from autopar.ir.ops import CONTRACTIONS
from autopar.passes.roll import SCOPE as ROLL_SCOPE
from autopar.plan.plan import Plan, is_note
from autopar.plan.schedule import schedule_line, timeline
from autopar.tools.inspect.format import (
    comm_key,
    format_seconds,
    full_bytes,
    kind_order,
    layer_family,
    layer_of_op,
    layer_of_path,
    layer_order,
    local_bytes,
    local_shape,
    op_layers,
    param_args,
    phase_of_op,
    rolled_slots,
    shape_text,
    split_picture,
)
from autopar.tools.inspect.tables import Table, render


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

    args = param_args(r.path for r in plan.inputs)
    for r in plan.inputs:
        d = row(layer_of_path(r.path, args))
        d["arrays"] += 1
        d["sharded_arrays"] += bool(r.spec.used_axes)
        d["bytes"] += full_bytes(r)
        d["local_bytes"] += local_bytes(r, plan.mesh)
    for name, o in op_layers(plan):
        d = row(name)
        d["ops"] += 1
        d["compute_s"] += o.compute_s
        if o.op in CONTRACTIONS:
            c = d["contraction_strategies"]
            c[o.strategy] = c.get(o.strategy, 0) + 1
    return list(rows.values())


def rolled_layer_notes(plan: Plan, rows: list[dict]) -> list[str]:
    """What the layer rows of a plan whose unrolled layers were rolled into loops
    (`autopar.passes.roll`) count: the slots' rows hold the loops' body ops that name
    their layer, and the ops outside the layers, replayed by autopar, name no module.
    Of any other plan whose ops name no module at all (plain functions): that."""
    slots = sorted(set(rolled_slots(plan.pipeline).values()), key=layer_order)
    top = next((d["ops"] for d in rows if d["layer"] == "(top level)"), 0)
    silent = sorted(
        (
            d["layer"]
            for d in rows
            if d["arrays"] and not d["ops"] and d["layer"] not in slots and d["layer"][0] != "("
        ),
        key=layer_order,
    )
    if not slots:
        named = any(d["ops"] for d in rows if d["layer"][0] != "(")
        if silent and top and not named:
            return [
                "0 ops in every row but (top level): the step's ops name no module (a "
                "model written as plain functions, without Flax or NNX modules and their "
                f"name scopes), so all {top} are there; the arrays are grouped by their paths"
            ]
        return []
    rolled = plan.pipeline["rolled"]
    k = rolled["layers"] // max(rolled["stages"], 1)
    loops = [o for o in plan.ops if o.body is not None and o.key.startswith(ROLL_SCOPE + "/")]
    unnamed = sum(
        name == ROLL_SCOPE and o.body is None and not o.key.startswith(ROLL_SCOPE + "/")
        for name, o in op_layers(plan)
    )
    notes = [
        f"{', '.join(slots)}: the layer slots {rolled['template']} was rolled into "
        f"(slot j holds layers j, {k}+j, ..., one per stage); their ops are the rolled "
        "loops' body ops that name their layer (one run of the body: one layer, one "
        f"micro-batch) and the optimizer's on the slot's arrays; {ROLL_SCOPE}: the "
        f"{len(loops)} loops themselves, their compute the pipelined loops' whole time "
        "(the bodies' included)"
        + (
            f", and the {unnamed} body ops that name no layer (the model's modules add no "
            "name scopes, as NNX's), which run the slots' layers"
            if unnamed
            else ""
        )
    ]
    if silent and top:
        notes.append(
            f"{', '.join(silent)}: 0 ops listed, yet ops outside the layers read them: "
            "autopar replays the step's ops outside the rolled layers (embedding, head, "
            "loss, optimizer) to roll the layers, and those ops name no module; they are "
            f"among the {top} ops under (top level)"
        )
    return notes


def _layer_signatures(plan: Plan) -> dict[str, tuple]:
    """Per layer, what must agree for repeated layers to share a row: each array's path
    within the layer, shape, dtype and spec, and each op's strategy and specs."""
    sig: dict[str, list] = {}
    args = param_args(r.path for r in plan.inputs)
    for r in plan.inputs:
        name = layer_of_path(r.path, args)
        rel = r.path.split(name, 1)[-1]
        sig.setdefault(name, []).append((rel, r.shape, r.dtype, r.spec.to_json()))
    for name, o in op_layers(plan):
        rel = re.sub(r"#\d+$", "", o.key.split(name, 1)[-1])
        sig.setdefault(name, []).append((rel, o.strategy, o.in_specs, o.out_specs))
    return {k: tuple(sorted(map(repr, v))) for k, v in sig.items()}


def collapse_layers(rows: list[list[str]], sigs: dict[str, tuple]) -> tuple[list, list[str]]:
    """Layer-table rows with repeated numbered layers (`layers/0` ... `layers/31`) that
    agree (the same arrays, ops, specs and strategies; the row shows the first one's
    compute) as one row `layers/* ×32`; the members that differ stay rows of their own,
    named in a note. Returns (rows, notes)."""
    families: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        fam = layer_family(r[0])
        if fam:
            families.setdefault(fam, []).append(i)
    out, notes, done = [], [], set()
    for i, r in enumerate(rows):
        if i in done:
            continue
        fam = layer_family(r[0])
        members = families.get(fam, []) if fam else []
        # the same arrays, ops and specs (the compute column may differ in rounding)
        key = lambda j: (tuple(rows[j][1:6]), tuple(rows[j][7:]), sigs.get(rows[j][0]))  # noqa: E731
        common = Counter(key(j) for j in members).most_common(1)
        if len(members) < 2 or common[0][1] < 2:
            out.append(r)
            continue
        same = [j for j in members if key(j) == common[0][0]]
        others = [j for j in members if j not in same]
        out.append([f"{fam} ×{len(same)}", *rows[same[0]][1:]])
        out += [rows[j] for j in others]
        done.update(members)
        note = f"{fam} ×{len(same)}: {len(same)} layers with the same arrays, specs and strategies"
        shown = lambda j: (tuple(rows[j][1:6]), tuple(rows[j][7:]))  # noqa: E731
        hidden = [rows[j][0] for j in others if shown(j) == shown(same[0])]
        if others:
            note += "; except " + ", ".join(rows[j][0] for j in others) + " (listed)"
        if hidden:  # their rows read as the others': what differs is not a column
            note += (
                f"; {', '.join(hidden)} differ{'s' * (len(hidden) == 1)} in the specs or "
                "strategies of some arrays or ops, not in these totals (--by param or "
                "--by op shows them)"
            )
        notes.append(note)
    return out, notes


def input_rows(plan: Plan) -> list[dict]:
    out = []
    args = param_args(r.path for r in plan.inputs)
    for r in plan.inputs:
        shards = r.spec.shards(plan.mesh)
        out.append(
            {
                "path": r.path,
                "layer": layer_of_path(r.path, args),
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
    if plan.pipeline:
        t = timeline(plan.pipeline)
        out["schedule"] = {
            "schedule": t.schedule,
            "stages": t.stages,
            "microbatches": t.microbatches,
            "pipelined_s": t.seconds,
            "bubble": t.bubble,
            "estimated": t.estimated,
            "held_per_stage": [t.in_flight(s) for s in range(t.stages)],
            "slots": t.rows(width=10**6),
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
                _chosen(plan) if k == plan.engine else "",
            ]
        )
    return [cost, comm, cands]


def _chosen(plan: Plan) -> str:
    """The chosen candidate's mark, with the plan's price where it differs (its layouts
    re-priced under ZB-H1)."""
    mine = plan.candidates[plan.engine]
    if math.isclose(mine.step_s, plan.cost.step_s, rel_tol=1e-9):
        return "<- chosen"
    return f"<- chosen ({format_seconds(plan.cost.step_s)} as it runs)"


def inspect_tables(plan: Plan, by: str = "param") -> list[Table]:
    tables = cost_tables(plan)
    if by == "param":
        rows = sorted(
            input_rows(plan),
            key=lambda r: (layer_order(r["layer"]), kind_order(r["path"]), r["path"]),
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
            "split: one bar per dimension; █ = every device holds it whole, a bar of k "
            "cells = split k ways (▓ is one device's share: ▓░░░ is 4 ways, ▓░░░░░░░ 8). "
            "R = replicated, S[axes] = sharded."
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
        rows = []
        for d in sorted(layer_rows(plan), key=lambda d: layer_order(d["layer"])):
            cs = d["contraction_strategies"]
            top = max(cs.items(), key=lambda kv: kv[1]) if cs else None
            rows.append(
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
        t.rows, t.notes = collapse_layers(rows, _layer_signatures(plan))
        t.notes += rolled_layer_notes(plan, layer_rows(plan))
        tables.append(t)
    elif by == "op":
        rows = op_rows(plan)
        order = sorted(range(len(rows)), key=lambda i: (layer_order(rows[i]["layer"]), i))
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
    if plan.pipeline:
        t = timeline(plan.pipeline)
        sched = Table(
            f"pipeline schedule ({schedule_line(t).removeprefix('schedule: ')})",
            [
                "stage",
                "slots in order (F/B/H<micro-batch>: forward, backward, head"
                + ("; W: weight gradients" if t.schedule == "zb-h1" else "")
                + ("; .c: through chunk c" if t.virtual > 1 else "")
                + "; . idle)",
            ],
        )
        sched.rows = [line.split(": ", 1) for line in t.rows()]
        tables.append(sched)
    if plan.warnings:
        tables.append(
            Table(
                "warnings",
                ["warning"],
                rows=[[f"note: {w}" if is_note(w) else w] for w in plan.warnings],
            )
        )
    return tables


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
