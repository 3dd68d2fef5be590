"""`autopar diff`: what changed from one plan to another (context, costs, inputs,
outputs, ops), as JSON-able data and as tables."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from autopar.errors import format_bytes
from autopar.plan.plan import Plan
from autopar.plan.records import TensorRecord
from autopar.tools.inspect.format import (
    format_delta_bytes,
    format_delta_seconds,
    format_seconds,
    kind_order,
    layer_of_op,
    layer_of_path,
    layer_order,
    local_bytes,
    param_args,
    shape_text,
)
from autopar.tools.inspect.tables import Table, render


def _pct(a: float, b: float) -> str:
    if a == 0:
        return "" if b == 0 else "(new)"
    return f"({(b - a) / a * 100:+.1f}%)"


def _records(rs: Iterable[TensorRecord]) -> dict[str, TensorRecord]:
    return {r.path: r for r in rs}


def _described(r: TensorRecord) -> str:
    """A leaf's type and layout, and the pipeline stage that holds it, if one does."""
    on = f" on stage {r.stage}" if r.stage is not None else ""
    return f"{r.dtype}{shape_text(r.shape)} {r.spec}{on}"


def _remat(p: Plan) -> str | None:
    if p.remat and p.remat_layers is not None:
        return f"{p.remat} (first {p.remat_layers} layers)"
    return p.remat


def _pipeline(p: Plan) -> str | None:
    d = p.pipeline
    if not d:
        return None
    v = f" x {d['virtual_stages']} virtual" if d.get("virtual_stages") else ""
    return f"{d['stages']} stages{v}, {d['microbatches']} micro-batches, {d['schedule']}"


def _budget(p: Plan) -> str | None:
    return None if p.memory_budget is None else format_bytes(p.memory_budget)


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
    # the options the plans were made under, where either plan says
    for name, va, vb in (
        ("remat", _remat(a), _remat(b)),
        ("precision", a.precision, b.precision),
        ("grad_accumulation", a.grad_accumulation, b.grad_accumulation),
        ("pipeline", _pipeline(a), _pipeline(b)),
        ("memory_budget", _budget(a), _budget(b)),
    ):
        if va is not None or vb is not None:
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
        args = param_args([*ma, *mb])
        changed, only_a, only_b = [], [p for p in ma if p not in mb], [p for p in mb if p not in ma]
        for p, x in ma.items():
            y = mb.get(p)
            if y is None:
                continue
            if (x.shape, x.dtype, x.spec, x.stage) != (y.shape, y.dtype, y.spec, y.stage):
                changed.append(
                    {
                        "path": p,
                        "layer": layer_of_path(p, args),
                        "a": _described(x),
                        "b": _described(y),
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
                    "layer": x.layer or layer_of_op(k),
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
        # a pipelined plan of layers unrolled in Python describes the rolled program
        # (`inputs`) and the user's leaves (`user_inputs`): the user's are compared
        "inputs": tensors(a.user_inputs or a.inputs, b.user_inputs or b.inputs),
        "outputs": tensors(a.user_outputs or a.outputs, b.user_outputs or b.outputs),
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


_COUNTER = re.compile(r"#\d+")


def _folded(rows: list[list[str]], layers: list[str]) -> tuple[list[list[str]], list[str]]:
    """Rows grouped by layer (`layers`, parallel), a layer whose rows repeat those of a
    layer shown before it (its own name aside) folded into that one, whose group says
    so: a 32-layer model's diff listed every layer's identical changes (1,600 lines for
    4 layers of a tiny Llama)."""
    by: dict[str, list[list[str]]] = {}
    for row, layer in zip(rows, layers):
        by.setdefault(layer, []).append(row)
    first: dict[tuple, str] = {}
    alike: dict[str, list[str]] = {}
    for layer, rs in by.items():
        # its name and op counters aside (`dot_general#12` in layer 3 is layer 0's `#4`)
        sig = tuple(tuple(_COUNTER.sub("#", c.replace(layer, "<layer>")) for c in r) for r in rs)
        if layer and not layer.startswith("(") and sig in first:
            alike[first[sig]].append(layer)
        else:
            first.setdefault(sig, layer)
            alike[layer] = []
    out_rows, groups = [], []
    for layer, more in alike.items():
        shown = f"{layer} (and {len(more)} alike: {_few(more)})" if more else layer
        out_rows += by[layer]
        groups += [shown] * len(by[layer])
    return out_rows, groups


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f", ... {names[-1]}" if len(names) > n else "")


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
                key=lambda c: (layer_order(c["layer"]), kind_order(c["path"]), c["path"]),
            ),
        }
        rows, groups = _folded(
            [
                [
                    c["path"],
                    c["a"],
                    c["b"],
                    format_delta_bytes(c["b_local_bytes"] - c["a_local_bytes"]),
                ]
                for c in t["changed"]
            ],
            [c["layer"] for c in t["changed"]],
        )
        tab = Table(
            f"{part}: {len(t['changed'])} changed",
            ["path", "a", "b", "per device"],
            groups=groups,
            right=(3,),
        )
        tab.rows = rows
        tab.notes += [f"only in a: {p}" for p in t["only_a"]]
        tab.notes += [f"only in b: {p}" for p in t["only_b"]]
        tables.append(tab)
    o = d["ops"]
    order = {c["key"]: i for i, c in enumerate(o["changed"])}
    o = {
        **o,
        "changed": sorted(o["changed"], key=lambda c: (layer_order(c["layer"]), order[c["key"]])),
    }
    per_layer = Counter(c["layer"] for c in o["changed"])
    rows, groups = _folded(
        [
            [c["key"], c["source"], c["a"], c["b"], format_delta_seconds(c["compute_delta_s"])]
            for c in o["changed"]
        ],
        [c["layer"] for c in o["changed"]],
    )
    tab = Table(
        f"ops: {len(o['changed'])} changed, {o['unchanged']} unchanged",
        ["key", "source", "a", "b", "compute delta"],
        groups=groups,
        right=(4,),
    )
    tab.rows = rows
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
