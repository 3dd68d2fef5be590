"""Formatting and grouping shared by every plan report (and by `autopar render`):
seconds and byte deltas, op and argument keys to layers and phases, per-device sizes,
and the one-line picture of how an array is split."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Iterable, Sequence

import numpy as np

from autopar.errors import format_bytes
from autopar.passes.roll import SCOPE as ROLL_SCOPE
from autopar.plan.plan import Plan
from autopar.plan.records import OpRecord, TensorRecord
from autopar.sharding import MeshInfo, Spec

# Path components that hold a model's arrays rather than name a part of the model.
_CONTAINERS = {"params", "opt_state", "batch_stats", "mu", "nu", "count", "state", "inner_state"}
# Optimizer state that mirrors the parameters' tree (optax's Adam moments).
_MOMENTS = {"mu", "nu"}
# A numbered layer's name: `h_3`, `layers/3` (transformers, NNX lists), `h.3` (dotted).
LAYER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)*?(?:_?|[./])\d+$")
# A group of layers rolled into a pipeline's loops (`autopar.passes.roll`): `h_<0,2>`
# as one part, or `<0,2>` after the name of the collection (`layers/<0,2>`).
_GROUP_RE = re.compile(r"^(?:[A-Za-z][A-Za-z0-9_.]*)?<\d+(?:,\d+)*>$")
_PICTURE_CELLS = 16
# A name-stack part that can name a module (not an einsum's subscripts, `bqd,bkd->bqk`).
_NAME_RE = re.compile(r"^[A-Za-z0-9_.]*$")


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


def itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        if dtype.startswith("key<"):
            return _key_itemsize(dtype)
        import jax.numpy as jnp

        return jnp.dtype(dtype).itemsize


@functools.cache
def _key_itemsize(dtype: str) -> int:
    """Bytes of one typed PRNG key of dtype `key<fry>`, `key<rbg>`, ... (its words)."""
    import jax

    for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
        dt = jax.eval_shape(lambda impl=impl: jax.random.key(0, impl=impl)).dtype
        if str(dt) == dtype:
            return dt.itemsize
    return np.dtype(np.uint32).itemsize  # a key of another impl: one word, as the planner prices it


def comm_key(key: str) -> tuple[str, tuple[str, ...]]:
    """`"all-reduce@data,model"` -> `("all-reduce", ("data", "model"))`."""
    kind, _, axes = key.partition("@")
    return kind, tuple(a for a in axes.split(",") if a)


# ---------------------------------------------------------------------------- grouping


def _numbered(parts: Sequence[str], first: int = 1) -> str | None:
    """The first numbered layer among path parts: `h_3` or `h.3` as one part, or a name
    followed by an index (`layers`, `3` -> `layers/3`; from `first` on, so an argument's
    own tuple index is not one); indices after containers (`opt_state/0`) are not."""
    for i, p in enumerate(parts):
        if "(" in p:
            continue
        if _GROUP_RE.match(p):
            return p if p[0] != "<" or i == 0 else f"{parts[i - 1]}/{p}"
        if LAYER_RE.match(p):
            return p
        if p.isdigit() and i >= first and i > 0:
            prev = parts[i - 1]
            if not prev.isdigit() and prev not in _CONTAINERS and "(" not in prev:
                return f"{prev}/{p}"
    return None


def layer_of_path(path: str, param_args: Collection[str] = ()) -> str:
    """The part of the model an argument belongs to: `state/params/h_3/attn/q/kernel` ->
    `h_3`, `params/model/layers/3/mlp/kernel` -> `layers/3`, `state/opt_state/0/mu/wte/embedding`
    -> `wte`; arrays outside params / optimizer state group under their argument's name
    (`batch/inputs` -> `batch`) unless they name a numbered layer (an NNX state's
    `model/blocks/0/linear/kernel` -> `blocks/0`). A plain pytree of parameters (`p/wte`,
    its argument `p` among `param_args`, which `param_args(paths)` finds) and optax's
    moments of it (`o/0/mu/wte`) group as `params/...` would."""
    parts = path.split("/")
    if parts[0] in param_args or any(p in _MOMENTS for p in parts[1:]):
        parts = [parts[0], "params", *parts[1:]]
    if not any(p in ("params", "opt_state", "batch_stats") for p in parts):
        return _numbered(parts[:-1], first=2) or parts[0]
    layer = _numbered(parts[1:-1])
    if layer:
        return layer
    rest = [p for p in parts[1:] if p not in _CONTAINERS and not p.isdigit()]
    if rest:
        return rest[0]
    return "(optimizer)" if "opt_state" in parts else "(other)"


def param_args(paths: Iterable[str]) -> frozenset[str]:
    """The arguments that are a plain pytree of parameters (no `params` collection): those
    whose leaves optax's moments mirror (`p/layers/0/w` beside `o/0/mu/layers/0/w`)."""
    paths = list(paths)
    mirrored = set()
    for path in paths:
        parts = path.split("/")
        at = next((i for i, p in enumerate(parts[1:], 1) if p in _MOMENTS), None)
        if at is not None:
            mirrored.add("/".join(parts[at + 1 :]))
    return frozenset(
        p.split("/", 1)[0] for p in paths if "/" in p and p.split("/", 1)[1] in mirrored
    )


def _named(part: str) -> bool:
    return bool(_NAME_RE.match(part) or _GROUP_RE.match(part))


TOP = "(top level)"  # the row of ops that name no layer or module


def layer_of_op(key: str) -> str:
    """The layer an op key's name stack names: `transpose(jvp(GPT))/h_0/mlp/c_fc/dot_general#1`
    -> `h_0`, `jvp(Llama)/model/layers/3/self_attn/...` -> `layers/3`,
    `jvp(GPT)/wte.attend/dot_general#0` -> `wte`. Ops outside every module (the loss under
    `jvp()`, the optimizer with no name stack) -> `(top level)`."""
    stack = key.split("/")[:-1]
    wrapped = [p for p in stack if "(" in p]
    inner = re.sub(r"^.*\(|\).*$", "", wrapped[0]) if wrapped else None
    if inner and not _named(inner):  # `jvp(bqd,bkd->bqk)`: an einsum's, no module
        inner = ""
    named = [
        p if LAYER_RE.match(p) else p.split(".", 1)[0]
        for p in stack
        if "(" not in p and not p.startswith("_") and _named(p)
    ]
    layer = _numbered(named, first=0)
    if layer:
        return layer
    if named and inner != "":
        return named[0]
    return inner or TOP


def rolled_slots(pipeline: dict | None) -> dict[str, str]:
    """For a plan whose layers unrolled in Python run rolled into loops over stages
    (`autopar.passes.roll`; `pipeline["rolled"]`): the layer names its ops go by -> the
    name of their layer slot's row, as the slot's grouped arrays spell it. Slot `j` holds
    layers `j, k + j, ...` (one per stage); the loops' bodies name it after layer `j`
    (`h_0` -> `h_<0,2>`, `layers/0` -> `layers/<0,2>`), the optimizer's update of its
    arrays `rolled_layers_slot<j>`. Empty for other plans."""
    rolled = (pipeline or {}).get("rolled")
    if not rolled:
        return {}
    parts = rolled["template"].split("/")
    tail = "/".join(parts[-2:]) if parts[-1] == "<i>" and len(parts) > 1 else parts[-1]
    stages, layers = int(rolled["stages"]), int(rolled["layers"])
    k, p = layers // max(stages, 1), int(rolled.get("period", 1))  # units of p layers
    out = {}
    for j in range(k):
        for q in range(p):
            ids = ",".join(str((s * k + j) * p + q) for s in range(stages))
            group = tail.replace("<i>", f"<{ids}>")
            out[tail.replace("<i>", str(j * p + q))] = group
            out.setdefault(f"{ROLL_SCOPE}_slot{j}", group)
    return out


def op_layers(plan: Plan) -> list[tuple[str, OpRecord]]:
    """Each op of `plan` with its layer (`layer_of_op`). In a plan whose unrolled layers
    were rolled into loops, the loops' body ops too (one run of the body), each under
    its layer slot (`rolled_slots`), as the optimizer's ops on the slot's arrays; the
    loops themselves stay under their own scope (`rolled_layers`)."""
    slots = rolled_slots(plan.pipeline)
    out = []
    for o in plan.ops:
        name = layer_of_op(o.key)
        if name == TOP and o.layer:  # its name says none: where the search placed it
            name = o.layer
        out.append((slots.get(name, name), o))
        if slots and o.body is not None and o.key.startswith(ROLL_SCOPE + "/"):
            for b in o.body.ops:
                inner = layer_of_op(b.key)
                out.append((slots.get(inner, name), b))
    return out


def layer_family(name: str) -> str | None:
    """`layers/3` -> `layers/*`, `h_3` -> `h_*`, `h.3` -> `h.*`; None for a name that is
    not a numbered layer."""
    m = re.match(r"^(.*?[_./]?)(\d+)$", name)
    if not m or not LAYER_RE.match(name):
        return None
    return m.group(1) + "*"


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


# ---------------------------------------------------------------------------- sorting


def kind_order(path: str) -> int:
    """Parameters first, then optimizer state, then everything else."""
    parts = path.split("/")
    return 0 if "params" in parts else 1 if "opt_state" in parts else 2


def layer_order(name: str):
    """Sort `h_2` before `h_10`; the rest alphabetically, `(top level)` last."""
    m = re.match(r"^(.*?)(\d+)$", name)
    if name.startswith("("):
        return (2, name, 0)
    if m:
        return (0, m.group(1), int(m.group(2)))
    return (1, name, 0)
