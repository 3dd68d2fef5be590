"""Read the collectives out of a compiled XLA program's text.

``parse_collectives(jax.jit(f).lower(...).compile().as_text(), mesh)`` lists every
collective of the program (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute) with its per-device size, its replica groups, and, when a mesh is
given, the mesh axes its groups run along.  Used to check that a sharded program contains
the communication a plan predicted, and to price compiled programs.

What JAX 0.10.2's CPU compiler actually prints (checked by compiling real programs on 8
simulated CPU devices):

* GSPMD-partitioned collectives (from ``jax.jit`` with ``NamedSharding``s) use the
  *mesh-axes* form::

      replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}
      replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}

  The mesh is XLA's own synthetic mesh (``axis_0``, ``axis_1``, ... are *not* the JAX
  axis names), its device list is an iota ``[dims]T(perm)`` (absent means plain
  ``0..N-1``) or, in principle, an explicit id list, and the braces name the axes the
  groups vary along (sub-axes print as ``'a':(pre_size)size``).  Groups are: reshape the
  device list to the mesh shape, move the named axes last, split into rows.
* ``shard_map`` collectives (``psum``, ``psum_scatter``, ``all_gather``, ``all_to_all``)
  use explicit lists ``replica_groups={{0,1,2,3},{4,5,6,7}}``.
* Collective-permutes print ``source_target_pairs={{0,1},{1,2},...}``.
* The iota form ``replica_groups=[2,4]<=[4,2]T(1,0)`` and the empty form
  ``replica_groups={}`` were not seen on CPU with this version, but older/other XLA
  builds print them, so both are supported (tested on literal HLO).
* No async ``-start``/``-done`` pairs appear on CPU; they are supported anyway (the start
  is counted, the done skipped), as are collectives wrapped by ``async-start`` (they are
  counted where they appear, inside the wrapped computation).
* **Reduce-scatter:** the CPU compiler does *not* turn GSPMD's "all-reduce then keep my
  slice" into a reduce-scatter: a matmul whose contracted dim is sharded on ``model``
  with output ``P('model', None)`` compiles to a full ``all-reduce`` over ``model``
  followed by a ``dynamic-slice`` fusion indexed by ``partition-id``.  A real
  ``reduce-scatter`` instruction only appears from ``jax.lax.psum_scatter`` inside
  ``shard_map``.  Since ``bytes`` is the full-size side, both forms report the same bytes
  (the unreduced operand); only ``kind`` differs.
* All GSPMD all-reduce/all-gather/reduce-scatter carry ``channel_id`` and
  ``use_global_device_ids=true``; all-to-all and collective-permute carry ``channel_id``
  only (cross-partition mode).  The module header carries ``num_partitions=8``
  (``replica_count`` is omitted, i.e. 1).

Device ids.  With ``replica_count=1`` the ids in the groups are partition (logical
device) ids, i.e. *positions* in the executable's device assignment, which for a program
jitted over a mesh is ``mesh.devices.flat``.  Verified: a mesh built from a permuted
device list (``Device.id`` order 3,1,7,0,...) compiles to exactly the same HLO as the
in-order mesh.  So axes are matched **by position in ``mesh.devices.flat``**, never by
``Device.id``.  Group ids are kept as XLA prints them except in cross-replica-and-partition
mode (``channel_id`` without ``use_global_device_ids`` on an op that has that
attribute), where each replica group is expanded to the global ids
``replica * num_partitions + partition`` of all its participants.

Byte sizes are per device, of the full-size side: all-reduce operand, all-gather result,
reduce-scatter operand, all-to-all operand, collective-permute operand; tuple-shaped
(combined) collectives sum their elements.  Operand shapes are looked up from the
instructions that define them (compiled HLO text prints operands by name only).

Loops: ``in_loop`` is True for collectives in a while body or condition computation, or
in any computation reachable from one (``calls=``, ``to_apply=``, branches, nested
whiles).  ``runs`` multiplies the ``known_trip_count`` of every while loop around a
collective (XLA records it on loops of a static length, as ``scan`` and ``fori_loop``
make); ``summarize(..., per_step=True)`` counts each collective that many times.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.tools.replica_groups import (
    COMMENT_RE,
    attr_value,
    balanced,
    ints,
    match_axes,
    parse_replica_groups,
    permute_components,
    replica_groups_attr,
    split_top,
)

if TYPE_CHECKING:
    import jax

__all__ = [
    "HloCollective",
    "parse_collectives",
    "parse_replica_groups",
    "shape_bytes",
    "summarize",
]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Ops that have a use_global_device_ids attribute (the others are cross-partition when
# they have a channel_id).
_HAS_GLOBAL_IDS_ATTR = ("all-reduce", "all-gather", "reduce-scatter")


@dataclass(frozen=True)
class HloCollective:
    kind: str
    """"all-reduce" | "all-gather" | "reduce-scatter" | "all-to-all" | "collective-permute"."""
    bytes: int
    """Per-device bytes of the full-size side (see module docstring)."""
    dtype: str
    """Element type, e.g. "f32" (the first element's, for tuples)."""
    group_size: int
    """Devices per replica group.  For collective-permute: the size of the largest connected
    component of the source->target graph (2 for a pairwise swap, n for a ring of n).
    0 when unknown (empty ``replica_groups={}`` with no module header and no mesh)."""
    groups: tuple[tuple[int, ...], ...]
    """Replica groups as device ids / partition ids (positions in the device assignment).
    For collective-permute: the connected components of the pair graph (devices in no pair
    are left out)."""
    axes: tuple[str, ...] | None
    """Mesh axes the groups run along (mesh order), when a mesh is given and they match."""
    name: str
    """HLO instruction name (without the ``%``)."""
    in_loop: bool
    """True when inside a while body/condition, directly or through called computations."""
    runs: int = 1
    """How many times a step runs it: the product of the known trip counts of the while
    loops around it (a loop without ``known_trip_count`` counts once), summed over the
    places its computation is called from."""


# --------------------------------------------------------------------------- shapes

_ARRAY_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


def _dtype_bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    if dtype in ("token", "opaque"):
        return 0
    if dtype.startswith("f8"):
        return 8
    if dtype.startswith("f4"):
        return 4
    m = re.match(r"[a-z]+(\d+)", dtype)
    if m is None:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(m.group(1))


def _array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """All array shapes in an HLO shape string (a tuple yields its leaves, in order)."""
    out = []
    # Layouts ({1,0}, {1,0:T(8,128)}) hold no ``x[...]`` patterns; comments may hold
    # ``index=5`` but no brackets.
    for dtype, dims in _ARRAY_SHAPE_RE.findall(shape):
        sizes = []
        for d in dims.split(","):
            d = d.strip().lstrip("<=").strip()
            if not d:
                continue
            sizes.append(int(d) if d.isdigit() else 0)  # "?" (unbounded) counts as 0
        out.append((dtype, tuple(sizes)))
    return out


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string such as ``f32[8,128]{1,0}`` or a tuple of them."""
    total = 0
    for dtype, dims in _array_shapes(shape):
        total += (math.prod(dims) * _dtype_bits(dtype) + 7) // 8
    return total


def _first_dtype(shape: str) -> str:
    shapes = _array_shapes(shape)
    return shapes[0][0] if shapes else ""


# --------------------------------------------------------------------------- text scanning


_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"^([\w\-]+)\(")
_CALLEE_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEE_LIST_RE = re.compile(r"\b(?:branch_computations|called_computations|calls)=\{([^}]*)\}")
_WHILE_RE = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_BODY_RE = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str


def _parse_instruction(line: str, computation: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if m is None:
        return None
    name, rest = m.group(1), m.group(2).strip()
    if not rest:
        return None
    try:
        if rest[0] == "(":
            end = balanced(rest, 0)
        else:
            end = rest.find(" ")
            if end < 0:
                return None
        shape, rest = rest[:end], rest[end:].strip()
        om = _OPCODE_RE.match(rest)
        if om is None:
            return None
        start = om.end() - 1
        end = balanced(rest, start)
    except ValueError:
        return None
    operands = split_top(COMMENT_RE.sub("", rest[start + 1 : end - 1]))
    attrs = rest[end:].lstrip(", ")
    return _Instr(name, shape, om.group(1), operands, attrs, computation)


def _operand_shape(operand: str, shapes: dict[str, str]) -> str | None:
    parts = operand.strip().rsplit(None, 1)
    if len(parts) == 2:  # typed operand, "f32[8]{0} %x"
        return parts[0]
    return shapes.get(parts[0].lstrip("%")) if parts else None


def _tuple_elements(shape: str) -> list[str]:
    shape = COMMENT_RE.sub("", shape.strip())
    if shape.startswith("("):
        return split_top(shape[1 : balanced(shape, 0) - 1])
    return [shape]


def parse_collectives(hlo_text: str, mesh: jax.sharding.Mesh | None = None) -> list[HloCollective]:
    """All collectives in a compiled HLO module's text, in textual order.

    ``mesh``: when given, each collective's groups are matched against the partitions of
    the mesh's device positions along every non-empty subset of its axes.
    """
    replica_count, num_partitions, has_header = 1, 1, False
    entry = ""  # the ENTRY computation
    trips: dict[tuple[str, str], int] = {}  # (computation, while body it runs) -> trip count
    instrs: list[_Instr] = []
    shapes: dict[str, str] = {}
    callees: dict[str, set[str]] = {}
    loop_roots: set[str] = set()
    current = ""
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("HloModule"):
            has_header = True
            if m := re.search(r"\breplica_count=(\d+)", stripped):
                replica_count = int(m.group(1))
            if m := re.search(r"\bnum_partitions=(\d+)", stripped):
                num_partitions = int(m.group(1))
            continue
        hm = _HEADER_RE.match(line)
        if hm and " = " not in line.split("(", 1)[0]:
            current = hm.group(2)
            callees.setdefault(current, set())
            if hm.group(1):
                entry = current
            continue
        if stripped == "}":
            current = ""
            continue
        ins = _parse_instruction(line, current)
        if ins is None:
            continue
        instrs.append(ins)
        shapes[ins.name] = ins.shape
        deps = callees.setdefault(current, set())
        deps.update(_CALLEE_RE.findall(ins.attrs))
        for group in _CALLEE_LIST_RE.findall(ins.attrs):
            deps.update(x.strip().lstrip("%") for x in group.split(",") if x.strip())
        if ins.opcode == "while":
            loop_roots.update(_WHILE_RE.findall(ins.attrs))
            trip = _TRIP_RE.search(ins.attrs)
            body = _BODY_RE.search(ins.attrs)
            if trip and body:
                trips[(current, body.group(1))] = int(trip.group(1))

    in_loop: set[str] = set()
    stack = list(loop_roots)
    while stack:
        c = stack.pop()
        if c in in_loop:
            continue
        in_loop.add(c)
        stack.extend(callees.get(c, ()))

    runs = _runs(callees, trips, entry)

    # Fallback size of the device domain for replica_groups={} without a header.
    max_id = -1
    for ins in instrs:
        for key in ("replica_groups", "source_target_pairs"):
            v = attr_value(ins.attrs, key)
            if v and v.startswith("{"):
                max_id = max([max_id, *ints(v)])

    out = []
    for ins in instrs:
        op = ins.opcode
        is_start = op.endswith("-start")
        kind = op[: -len("-start")] if is_start else op
        if kind not in KINDS:
            continue
        has_channel = attr_value(ins.attrs, "channel_id") is not None
        global_ids = (attr_value(ins.attrs, "use_global_device_ids") or "") == "true"

        if kind == "collective-permute":
            pairs_s = attr_value(ins.attrs, "source_target_pairs") or "{}"
            pairs = [ints(p) for p in re.findall(r"\{([^{}]*)\}", pairs_s[1:-1])]
            groups = permute_components([p for p in pairs if len(p) == 2])
            group_size = max((len(g) for g in groups), default=0)
        else:
            rg = replica_groups_attr(ins.attrs)
            parsed = parse_replica_groups(rg) if rg is not None else None
            # Collective op group mode (xla::CollectiveOpGroupMode).
            cross_replica_and_partition = (
                has_channel and not global_ids and kind in _HAS_GLOBAL_IDS_ATTR
            )
            if parsed is None:  # replica_groups={}: every participant in one group
                if not has_header:
                    n = int(mesh.devices.size) if mesh is not None else max_id + 1
                elif not has_channel or cross_replica_and_partition:
                    n = replica_count  # replica ids (expanded below for the latter)
                elif not global_ids:
                    n = num_partitions  # cross-partition
                else:
                    n = replica_count * num_partitions  # flattened ids
                parsed = (tuple(range(n)),) if n > 0 else ()
            if cross_replica_and_partition and has_header and num_partitions > 1:
                parsed = tuple(
                    tuple(r * num_partitions + p for r in g for p in range(num_partitions))
                    for g in parsed
                )
            groups = parsed
            group_size = max((len(g) for g in groups), default=0)

        operand_shapes = [_operand_shape(o, shapes) for o in ins.operands]
        known = all(s is not None for s in operand_shapes) and bool(operand_shapes)
        if kind == "collective-permute" and "slice_sizes=" in ins.attrs:
            operand_shapes = operand_shapes[:1]  # in-place form: (input, output, indices...)
        operand_bytes = sum(shape_bytes(s) for s in operand_shapes) if known else None
        dtype = _first_dtype(operand_shapes[0]) if known else _first_dtype(ins.shape)
        elems = _tuple_elements(ins.shape)
        if kind == "all-gather":
            if not is_start:
                nbytes = shape_bytes(ins.shape)
            elif known:
                nbytes = operand_bytes * group_size
            else:  # all-gather-start result: (operands, results)
                nbytes = shape_bytes(elems[-1] if len(elems) == 2 else ins.shape)
        elif kind == "reduce-scatter":
            nbytes = operand_bytes if known else shape_bytes(ins.shape) * group_size
        elif kind == "collective-permute":
            # collective-permute-start's result is (input, output, contexts...).
            nbytes = operand_bytes if known else shape_bytes(elems[0] if is_start else ins.shape)
        else:  # all-reduce, all-to-all: operand and result have the same size
            nbytes = operand_bytes if known else shape_bytes(ins.shape)

        axes = None
        if mesh is not None:
            axes = match_axes(groups, mesh, pad_singletons=kind == "collective-permute")
        out.append(
            HloCollective(
                kind=kind,
                bytes=int(nbytes),
                dtype=dtype,
                group_size=group_size,
                groups=groups,
                axes=axes,
                name=ins.name,
                in_loop=ins.computation in in_loop,
                runs=runs.get(ins.computation, 1),
            )
        )
    return out


def _runs(callees: dict[str, set[str]], trips: dict[tuple[str, str], int], entry: str):
    """Per computation, how many times one run of `entry` runs it: the sum over its
    callers of the caller's count times the trip count of the while loop that calls it
    (1 for any other call). Without an ENTRY (a fragment), every computation runs once."""
    callers: dict[str, list[tuple[str, int]]] = {}
    for c, cs in callees.items():
        for x in cs:
            callers.setdefault(x, []).append((c, trips.get((c, x), 1)))
    memo: dict[str, int] = {}

    def count(c: str, seen: frozenset = frozenset()) -> int:
        if c == entry or c not in callers or c in seen:
            return 1
        if c not in memo:
            memo[c] = sum(count(p, seen | {c}) * n for p, n in callers[c]) or 1
        return memo[c]

    return {c: count(c) for c in callees} if entry else {}


def summarize(
    collectives: Iterable[HloCollective], per_step: bool = False
) -> dict[tuple[str, tuple[str, ...] | None], int]:
    """Total bytes per ``(kind, axes)``: collectives in loops counted once, or, with
    ``per_step``, as many times as a step runs them (``HloCollective.runs``)."""
    totals: dict[tuple[str, tuple[str, ...] | None], int] = {}
    for c in collectives:
        key = (c.kind, c.axes)
        totals[key] = totals.get(key, 0) + c.bytes * (c.runs if per_step else 1)
    return totals
