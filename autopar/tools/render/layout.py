"""The model of the picture, from the plan alone: the layer boxes (`layer_groups`:
consecutive identical layers merged into one box) and the largest parameters
(`param_groups`: same-shaped, same-spec parameters across layers counted once)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from autopar.ir.ops import CONTRACTIONS
from autopar.plan.plan import Plan
from autopar.plan.records import TensorRecord
from autopar.sharding import Spec
from autopar.tools.inspect.format import (
    LAYER_RE,
    full_bytes,
    layer_of_path,
    local_bytes,
    op_layers,
    param_args,
)

MAX_BOXES = 40  # merge similar layers beyond this many boxes
DEFAULT_TOP = 8
REPLICATED = "replicated"


@dataclass
class LayerGroup:
    """One box: one layer, or a run of consecutive identical (or similar) layers."""

    names: list[str]
    identical: bool = True
    ops: int = 0  # per layer
    compute_s: float = 0.0  # per layer
    contractions: Counter = field(default_factory=Counter)  # strategy -> count, all layers
    param_bytes: int = 0  # per layer
    param_local_bytes: int = 0  # per layer
    split: str = REPLICATED  # the mesh axes that shard most of the parameter bytes
    has_params: bool = True  # False: its arrays are not parameters (the batch)
    state_bytes: int = 0  # per layer: its other arrays (optimizer moments)
    state_local_bytes: int = 0
    state_split: str = ""

    @property
    def label(self) -> str:
        if len(self.names) == 1:
            return self.names[0]
        word = "identical" if self.identical else "similar"
        return f"{self.names[0]}..{self.names[-1]} ({len(self.names)} {word})"

    @property
    def dominant(self) -> str | None:
        if not self.contractions:
            return None
        return max(self.contractions.items(), key=lambda kv: (kv[1], kv[0]))[0]

    @property
    def dominant_share(self) -> str:
        top = self.dominant
        total = sum(self.contractions.values())
        n = len(self.names)
        return f"{self.contractions[top] // n} of {total // n}" if top else ""


def _is_param(path: str, args: frozenset[str] = frozenset()) -> bool:
    parts = path.split("/")
    return "params" in parts or parts[0] in args


def _split_class(spec: Spec, mesh_axes: tuple[str, ...]) -> str:
    used = set(spec.used_axes)
    return ",".join(a for a in mesh_axes if a in used) or REPLICATED


def _replace_layer(parts: list[str], layer: str, repl: str) -> list[str]:
    """`parts` with every run naming `layer` (one part such as `h_3` or `h_3.attend`, or
    several for `layers/3`) replaced by `repl`."""
    want = layer.split("/")
    n, out, i = len(want), [], 0
    while i < len(parts):
        run = parts[i : i + n]
        last = run[-1] if len(run) == n else ""
        if run[:-1] == want[:-1] and (
            last == want[-1] or last.startswith(want[-1] + ".") or last.startswith(want[-1] + "(")
        ):
            out.append(repl)
            i += n
        else:
            out.append(parts[i])
            i += 1
    return out


def _normal(parts: list[str], layer: str) -> str:
    return "/".join(_replace_layer(parts, layer, "*"))


def _layer_data(plan: Plan):
    """Per layer: signature (for sameness), per-layer stats; and the layer order."""
    axes = plan.mesh.axis_names
    sig: dict[str, list] = {}
    stats: dict[str, LayerGroup] = {}
    split_bytes: dict[str, Counter] = {}
    state_split: dict[str, Counter] = {}
    first_input: dict[str, int] = {}
    first_op: dict[str, int] = {}

    def g(name: str) -> LayerGroup:
        if name not in stats:
            stats[name] = LayerGroup([name])
            sig[name] = []
            split_bytes[name] = Counter()
            state_split[name] = Counter()
        return stats[name]

    args = param_args(r.path for r in plan.inputs)
    has_params = {layer_of_path(r.path, args) for r in plan.inputs if _is_param(r.path, args)}
    for i, r in enumerate(plan.inputs):
        name = layer_of_path(r.path, args)
        d = g(name)
        first_input.setdefault(name, i)
        sig[name].append(
            ("in", _normal(r.path.split("/"), name), r.shape, r.dtype, r.spec.to_json())
        )
        if _is_param(r.path, args) or name not in has_params:
            b = full_bytes(r)
            d.param_bytes += b
            d.param_local_bytes += local_bytes(r, plan.mesh)
            split_bytes[name][_split_class(r.spec, axes)] += b
        else:
            b = full_bytes(r)
            d.state_bytes += b
            d.state_local_bytes += local_bytes(r, plan.mesh)
            state_split[name][_split_class(r.spec, axes)] += b
    for i, (name, o) in enumerate(op_layers(plan)):
        d = g(name)
        first_op.setdefault(name, i)
        d.ops += 1
        d.compute_s += o.compute_s
        if o.op in CONTRACTIONS:
            d.contractions[o.strategy] += 1
        sig[name].append(("op", _normal(o.key.split("/"), name), o.strategy, o.in_specs))
    for name, d in stats.items():
        d.has_params = name in has_params
        if split_bytes[name]:
            d.split = max(split_bytes[name].items(), key=lambda kv: (kv[1], kv[0]))[0]
        if state_split[name]:
            d.state_split = max(state_split[name].items(), key=lambda kv: (kv[1], kv[0]))[0]
    # Program order: layers only read as inputs (the batch, embeddings used at top level)
    # first, then layers in the order their first op runs; `(...)` groups last.
    inputs_only = sorted(
        (n for n in stats if n not in first_op and not n.startswith("(")),
        key=lambda n: (n in has_params, first_input[n]),
    )
    with_ops = sorted((n for n in first_op if not n.startswith("(")), key=lambda n: first_op[n])
    tail = sorted(
        (n for n in stats if n.startswith("(")),
        key=lambda n: (n in first_op, first_op.get(n, 0), first_input.get(n, 0)),
    )
    order = inputs_only + with_ops + tail
    return order, stats, {k: tuple(v) for k, v in sig.items()}


_NUM_RE = re.compile(r"^(.*?)(\d+)$")


def _next_in_run(prev: str, name: str) -> bool:
    a, b = _NUM_RE.match(prev), _NUM_RE.match(name)
    return bool(
        a
        and b
        and LAYER_RE.match(name)
        and a.group(1) == b.group(1)
        and int(b.group(2)) == int(a.group(2)) + 1
    )


def _merge(a: LayerGroup, b: LayerGroup, identical: bool) -> LayerGroup:
    n_a, n_b = len(a.names), len(b.names)
    n = n_a + n_b
    return LayerGroup(
        names=a.names + b.names,
        identical=identical and a.identical and b.identical,
        ops=round((a.ops * n_a + b.ops * n_b) / n),
        compute_s=(a.compute_s * n_a + b.compute_s * n_b) / n,
        contractions=a.contractions + b.contractions,
        param_bytes=round((a.param_bytes * n_a + b.param_bytes * n_b) / n),
        param_local_bytes=round((a.param_local_bytes * n_a + b.param_local_bytes * n_b) / n),
        split=a.split,
        has_params=a.has_params,
        state_bytes=round((a.state_bytes * n_a + b.state_bytes * n_b) / n),
        state_local_bytes=round((a.state_local_bytes * n_a + b.state_local_bytes * n_b) / n),
        state_split=a.state_split,
    )


def layer_groups(plan: Plan, max_boxes: int = MAX_BOXES) -> list[LayerGroup]:
    """The boxes of the layer picture, in program order."""
    order, stats, sig = _layer_data(plan)
    groups: list[LayerGroup] = []
    for name in order:
        d = stats[name]
        if groups:
            last = groups[-1]
            prev = last.names[-1]
            if last.identical and _next_in_run(prev, name) and sig[prev] == sig[name]:
                groups[-1] = _merge(last, d, True)
                continue
        groups.append(d)
    if len(groups) > max_boxes:
        merged: list[LayerGroup] = []
        for d in groups:
            if merged:
                last = merged[-1]
                if _next_in_run(last.names[-1], d.names[0]) and (last.dominant, last.split) == (
                    d.dominant,
                    d.split,
                ):
                    merged[-1] = _merge(last, d, False)
                    continue
            merged.append(d)
        groups = merged
    if len(groups) > max_boxes:  # still too many: merge runs of numbered layers regardless
        merged = []
        for d in groups:
            if merged and _next_in_run(merged[-1].names[-1], d.names[0]):
                merged[-1] = _merge(merged[-1], d, False)
            else:
                merged.append(d)
        groups = merged
    return groups


@dataclass
class ParamGroup:
    """Same-shaped parameters with the same spec, across layers (`h_*/mlp/c_fc/kernel`)."""

    name: str  # `h_*/mlp/c_fc/kernel` for several, else the parameter's own path
    record: TensorRecord  # the first of them
    count: int


def _short_path(path: str) -> str:
    parts = path.split("/")
    if "params" in parts:
        parts = parts[parts.index("params") + 1 :]
    return "/".join(parts)


def param_groups(plan: Plan, top: int = DEFAULT_TOP) -> list[ParamGroup]:
    """The `top` largest parameters, one per set of same-shape same-spec ones."""
    args = param_args(r.path for r in plan.inputs)
    records = [r for r in plan.inputs if _is_param(r.path, args) and r.shape]
    if not records:
        records = [r for r in plan.inputs if r.shape]
    groups: dict[tuple, ParamGroup] = {}
    for r in records:
        layer = layer_of_path(r.path, args)
        name = _short_path(r.path)
        m = _NUM_RE.match(layer)
        if m and LAYER_RE.match(layer):
            name = "/".join(_replace_layer(name.split("/"), layer, f"{m.group(1)}*"))
        key = (name, r.shape, r.dtype, r.spec)
        if key in groups:
            groups[key].count += 1
        else:
            groups[key] = ParamGroup(name, r, 1)
    for p in groups.values():
        if p.count == 1:
            p.name = _short_path(p.record.path)
    ranked = sorted(groups.values(), key=lambda p: (-full_bytes(p.record), p.name))
    return ranked[:top]
