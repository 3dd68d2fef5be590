"""Judge a compiled program without a cluster: read what XLA compiled on simulated CPU
devices and price it on a GPU profile.

What is read (``measure``):

* every collective, from ``autopar.tools.hlo.parse_collectives(text, mesh)``: kind, bytes of
  the full-size side, replica groups -> mesh axes, and the link tier of those axes
  (``MeshInfo.is_intra_node``);
* ``compiled.cost_analysis()`` flops and bytes accessed (per device);
* ``compiled.memory_analysis()``: arguments + outputs + temporaries - aliased, per device.

Three things the CPU backend compiles differently from a GPU, and how they are handled:

1. **All-reduce + dynamic-slice instead of reduce-scatter.** The CPU compiler keeps
   GSPMD's "all-reduce, then each device slices its part" (a GPU build runs XLA's
   reduce-scatter creator and fuses the pair). ``parse_collectives`` reports these as
   all-reduces of the full buffer. Here the pattern is *detected and reclassified*: an
   all-reduce (or one element of a combined, tuple-shaped all-reduce) whose every user is
   a ``dynamic-slice``, or a fusion containing one, producing at most ``1/n`` of the
   buffer (``n`` = group size) is priced as a reduce-scatter of the same full-size bytes
   (bus factor ``(n-1)/n`` instead of ``2(n-1)/n``). The count of reclassified
   collectives is recorded (``reclassified_rs``), as are the unreclassified bytes.
2. **bf16 collectives run in f32.** The CPU backend promotes bf16 collectives to f32 (a
   ``convert`` before and after, or an all-reduce whose reducer is a ``*_promoted``
   clone). A f32 collective element is counted at bf16 width (half its bytes) when its
   reducer was promoted, its operand is a bf16->f32 convert, or all its users convert it
   back to bf16. ``upcast_bytes`` records how many bytes were halved.

3. **bf16 dots and convolutions run in f32**, and XLA:CPU keeps f32 copies of their
   bf16 operands and results, which a GPU build does not. Memory is reported as
   compiled (``memory_analysis``) and, where the program was compiled with a dump
   directory, also less what those copies add to XLA's live peak
   (``f32_copies_at_peak``: XLA's own buffer sizes and live ranges, the copies found by
   the same two tests as in 2). A copy counts whole when the bf16 value is in memory
   anyway, and half when it stands in for the bf16 value a GPU build would keep (an f32
   buffer is twice that bf16 one): not a heuristic, and exact where the answer is known
   (``tests/test_evaluator.py``: the bf16 program's figure is exactly half the same
   program's f32 peak for matmul chains and an MLP forward). On gradient programs the
   copies are not all found (an MLP's gradient: 2/3 of the f32 peak instead of 1/2, a
   strict xfail there), so ``less_f32_copies`` is an upper bound on the bf16 footprint.

Collectives inside while loops are multiplied by the loop's ``known_trip_count`` (nested
loops multiply); the suite's models are unrolled, so the multiplier is 1 there.

Pricing (``price``), with ``autopar.cost.model.CostModel`` on a cost_models profile: compute is
the whole-program roofline ``max(flops / (peak(dtype) x eff), bytes / (HBM bw x eff))``;
each collective is ``CostModel.collective(kind, axes, bytes)`` (alpha + bus factor x bytes
/ link bandwidth of the slowest link its axes cross; an all-to-all's copies are kernels of
the program, so not added again). Reported: the no-overlap sum
``compute + comm`` and the perfect-overlap ``max(compute, comm)``.
"""

from __future__ import annotations

import glob
import os
import re
import time
from dataclasses import asdict, dataclass, field

import numpy as np

import cost_models
from autopar.cost.model import CostModel, default_f32_rate
from autopar.sharding import mesh_info
from autopar.tools.hlo import _parse_instruction, parse_collectives, shape_bytes

_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEE_LIST_RE = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_TO_APPLY_RE = re.compile(r"\bto_apply=%?([\w.\-]+)")
_DTYPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[")
# buffer-assignment values, `<id name{index} @position> (size=...`; live ranges `name{index}:a-b`
_VALUE_RE = re.compile(r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})? @\d+> \(size=(\d+)")
_RANGE_RE = re.compile(r"^\s+([\w.\-]+\{[\d,]*\}):(\d+)-(\d+)$", re.M)


def _dtype(shape: str) -> str:
    m = _DTYPE_RE.search(shape)
    return m.group(1) if m else ""


def _name(operand: str) -> str:
    return operand.strip().rsplit(None, 1)[-1].lstrip("%")


def _tuple_elems(shape: str) -> list[str]:
    s = re.sub(r"/\*.*?\*/", "", shape.strip())
    if not s.startswith("("):
        return [s]
    depth, cur, out = 0, [], []
    for c in s[1:-1]:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


class HloModule:
    """Just enough of a compiled module's text: instructions, users, callees, loops."""

    def __init__(self, text: str):
        self.instrs: dict[str, object] = {}
        self.comp_instrs: dict[str, list] = {}
        self.roots: dict[str, object] = {}
        self.callees: dict[str, list[tuple[str, int]]] = {}  # comp -> [(callee, mult)]
        self.entry = ""
        current = ""
        for line in text.splitlines():
            stripped = line.strip()
            if stripped.startswith("HloModule"):
                continue
            hm = _HEADER_RE.match(line)
            if hm and " = " not in line.split("(", 1)[0]:
                current = hm.group(2)
                if hm.group(1):
                    self.entry = current
                self.comp_instrs.setdefault(current, [])
                continue
            if stripped == "}":
                current = ""
                continue
            ins = _parse_instruction(line, current)
            if ins is None:
                continue
            self.instrs[ins.name] = ins
            self.comp_instrs.setdefault(current, []).append(ins)
            if stripped.startswith("ROOT"):
                self.roots[current] = ins
            trip = 1
            if ins.opcode == "while":
                m = _TRIP_RE.search(ins.attrs)
                trip = int(m.group(1)) if m else 1
            for key, callee in _CALLEE_RE.findall(ins.attrs):
                self.callees.setdefault(current, []).append(
                    (callee, trip if key in ("body", "condition") else 1)
                )
            for group in _CALLEE_LIST_RE.findall(ins.attrs):
                for c in group.split(","):
                    if c.strip():
                        self.callees.setdefault(current, []).append((c.strip().lstrip("%"), 1))
        self.users: dict[str, list] = {}
        for ins in self.instrs.values():
            for op in ins.operands:
                self.users.setdefault(_name(op), []).append(ins)
        # Execution multiplier per computation (loop trip counts, nested loops multiply).
        self.mult: dict[str, int] = {}
        stack = [(self.entry, 1)] if self.entry else []
        while stack:
            comp, m = stack.pop()
            if self.mult.get(comp, 0) >= m:
                continue
            self.mult[comp] = m
            for callee, k in self.callees.get(comp, ()):
                stack.append((callee, m * k))
        self.unknown_trip_loops = sum(
            1
            for ins in self.instrs.values()
            if ins.opcode == "while" and not _TRIP_RE.search(ins.attrs)
        )

    # -- patterns --------------------------------------------------------------------
    _LAYOUT = ("bitcast", "copy", "reshape", "transpose", "slice", "dynamic-slice")

    def _fused(self, ins) -> str | None:
        m = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
        return m.group(1) if m else None

    def produces_bf16_data(self, ins) -> bool:
        """``ins`` is f32 holding bf16 values: a convert from bf16, or a fusion whose root
        is one (behind layout ops)."""
        return self._bf16_source(ins) is not None

    def _bf16_source(self, ins):
        """The bf16 operand of the convert that makes ``ins`` (see
        ``produces_bf16_data``), or None."""
        if ins is None or _dtype(ins.shape) != "f32":
            return None
        root, comp = ins, None
        if ins.opcode == "fusion":
            comp = self._fused(ins)
            root = self.roots.get(comp or "")
        for _ in range(8):
            if root is None:
                return None
            if root.opcode == "convert":
                src = self._operand(root, 0, comp)
                return src if src is not None and _dtype(src.shape) == "bf16" else None
            if root.opcode not in self._LAYOUT:
                return None
            root = self._operand(root, 0, comp)
        return None

    def upcasts_a_bf16_buffer(self, ins) -> bool:
        """``ins`` converts a bf16 value that is in memory of its own (an operand, not a
        value made inside the same fusion), so the f32 copy is all extra."""
        src = self._bf16_source(ins)
        return src is not None and (ins.opcode != "fusion" or src.opcode == "parameter")

    def contracts(self, ins) -> bool:
        """``ins`` is a dot or convolution, or a fusion of one (XLA:CPU's ``ynn_fusion``)."""
        if ins.opcode in ("dot", "convolution"):
            return True
        comp = self._fused(ins) if ins.opcode == "fusion" else None
        return any(i.opcode in ("dot", "convolution") for i in self.comp_instrs.get(comp or "", []))

    def is_one_convert(self, ins) -> bool:
        """A convert, or a fusion of just one (XLA:CPU's ``wrapped_convert``)."""
        if ins.opcode != "fusion":
            return ins.opcode == "convert"
        body = self.comp_instrs.get(self._fused(ins) or "", [])
        return [i.opcode for i in body if i.opcode != "parameter"] == ["convert"]

    def _operand(self, ins, i: int, comp: str | None):
        if i >= len(ins.operands):
            return None
        return self.instrs.get(_name(ins.operands[i]))

    def consumes_as_bf16(self, user, value: str) -> bool:
        """Every use of ``value`` by ``user`` converts it to bf16 (behind layout ops)."""
        if user.opcode == "convert":
            return _dtype(user.shape) == "bf16"
        if user.opcode != "fusion":
            return False
        comp = self._fused(user)
        idx = [k for k, op in enumerate(user.operands) if _name(op) == value]
        params = [
            i
            for i in self.comp_instrs.get(comp or "", [])
            if i.opcode == "parameter" and i.operands and int(i.operands[0]) in idx
        ]
        if not params:
            return False
        inner_users: dict[str, list] = {}
        for i in self.comp_instrs.get(comp or "", []):
            for op in i.operands:
                inner_users.setdefault(_name(op), []).append(i)

        def ok(name: str, depth: int = 0) -> bool:
            us = inner_users.get(name, [])
            if not us or depth > 8:
                return False
            for u in us:
                if u.opcode == "convert" and _dtype(u.shape) == "bf16":
                    continue
                if u.opcode in self._LAYOUT and ok(u.name, depth + 1):
                    continue
                return False
            return True

        return all(ok(p.name) for p in params)

    def contains_dynamic_slice(self, ins, depth: int = 0) -> bool:
        if ins.opcode == "dynamic-slice":
            return True
        if ins.opcode != "fusion" or depth > 3:
            return False
        comp = self._fused(ins)
        return any(
            i.opcode == "dynamic-slice" or self.contains_dynamic_slice(i, depth + 1)
            for i in self.comp_instrs.get(comp or "", [])
        )

    def element_name(self, ins, index: int | None) -> list[str]:
        """The value names of ``ins``'s tuple element ``index`` (its get-tuple-elements)."""
        if index is None:
            return [ins.name]
        out = []
        for u in self.users.get(ins.name, []):
            m = re.search(r"\bindex=(\d+)", u.attrs)
            if u.opcode == "get-tuple-element" and m and int(m.group(1)) == index:
                out.append(u.name)
        return out

    def only_sliced(self, names: list[str], full_bytes: float, n: int, depth: int = 0) -> bool:
        """Every use of the values ``names`` keeps at most ``1/n`` of ``full_bytes`` through
        a dynamic-slice (looking through pure converts): GSPMD's reduce-scatter."""
        users = [(nm, u) for nm in names for u in self.users.get(nm, [])]
        if not users or depth > 4:
            return False
        for nm, u in users:
            if u.opcode == "convert" or (
                u.opcode == "fusion"
                and not self.contains_dynamic_slice(u)
                and self.consumes_as_bf16(u, nm)
                and _dtype(u.shape) == "bf16"
                and shape_bytes(u.shape) * 2 >= full_bytes * 0.999
            ):
                # A pure convert: follow it (its output is the full buffer at bf16 width).
                if not self.only_sliced([u.name], full_bytes, n, depth + 1):
                    return False
                continue
            if not self.contains_dynamic_slice(u):
                return False
            out_bytes = shape_bytes(_tuple_elems(u.shape)[0])
            if out_bytes * n > full_bytes * 1.0001:
                return False
        return True


@dataclass
class Coll:
    kind: str  # as priced (after reclassification)
    raw_kind: str  # as compiled
    bytes: float  # as priced (after the bf16 correction)
    raw_bytes: int
    dtype: str
    axes: tuple[str, ...]
    axes_matched: bool
    intra_node: bool
    mult: int
    upcast: bool
    name: str


@dataclass
class Measured:
    """What the compiled program does, per device."""

    compile_s: float
    flops: float
    bytes_accessed: float
    memory: dict[str, int]
    collectives: list[Coll] = field(default_factory=list)
    reclassified_rs: int = 0
    upcast_bytes: float = 0.0
    unknown_trip_loops: int = 0
    in_loop: int = 0
    # per kernel (`kernels`): (flops, bytes, times it runs) of each op a device launches
    kernels: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def comm_bytes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.collectives:
            k = f"{c.kind}@{','.join(c.axes)}"
            out[k] = out.get(k, 0.0) + c.bytes * c.mult
        return dict(sorted(out.items()))

    @property
    def total_comm_bytes(self) -> float:
        return sum(c.bytes * c.mult for c in self.collectives)

    def to_json(self) -> dict:
        d = asdict(self)
        d["collectives_count"] = len(self.collectives)
        d["comm_bytes"] = self.comm_bytes
        d["total_comm_bytes"] = self.total_comm_bytes
        del d["collectives"], d["kernels"]
        d["kernel_count"] = len(self.kernels)
        d["kernel_flops"] = sum(f * k for f, _, k in self.kernels)
        d["kernel_bytes"] = sum(b * k for _, b, k in self.kernels)
        return d


def compiled_memory(m) -> dict[str, int]:
    return {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "total": int(
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        ),
    }


def compile_lowered(lowered, dump_dir: str | None = None) -> tuple[object, float]:
    """Compile, timed; with ``dump_dir``, XLA also writes its buffer assignment and
    live ranges there (for ``measure``'s memory less the CPU's f32 copies)."""
    options = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True} if dump_dir else None
    t = time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    return compiled, time.perf_counter() - t


def _read_dump(dump_dir: str, suffix: str) -> str:
    files = glob.glob(os.path.join(dump_dir, f"*cpu_after_optimizations{suffix}"))
    with open(max(files, key=os.path.getsize)) as f:  # the program, not a helper module
        return f.read()


def f32_copies_at_peak(dump_dir: str, mod: HloModule | None = None) -> dict[str, int]:
    """How much of XLA's peak is f32 copies of bf16 data, from the dumped program,
    buffer assignment and live ranges (``compile_lowered(..., dump_dir)``).

    A temporary (not an argument) is such a copy when it is the CPU's doing around a
    dot or convolution: a convert from bf16 (behind layout ops) that only dots and
    convolutions read (their operand, upcast), or a dot or convolution whose every
    user converts it back to bf16 (its result, computed in f32). Upcasts the program
    asks for itself (a softmax in f32) are read by other ops and stay. A copy is all
    extra when the bf16 value is in memory anyway (an upcast of a bf16 buffer, or a
    result that plain converts turn into one); otherwise (a fusion that rounds an f32
    value to bf16 and back, a result whose bf16 is never written) it stands in for the
    bf16 value a GPU build would keep, and half of it is extra. The liveness curve is
    XLA's own (its schedule, each buffer live over its dumped range, at its assigned
    size); ``live_peak`` is its maximum, ``live_peak_less_f32_copies`` the maximum of
    the same curve without the copies. ``mod``: the program already parsed (the
    compiled text, whose names are the dump's)."""
    mod = mod or HloModule(_read_dump(dump_dir, ".txt"))
    sizes = {
        name + (index or "{}"): int(size)
        for name, index, size in _VALUE_RE.findall(_read_dump(dump_dir, "-buffer-assignment.txt"))
    }
    live = _read_dump(dump_dir, "-live-range.txt").split("BufferLiveRange:")[1]
    live = live.split("Live ranges at")[0]

    def extra(key: str) -> float:
        """The share of buffer `key` that is the CPU's f32 copy."""
        name = key.removesuffix("{}")  # tuple elements (`{0}`) are not looked into
        ins = mod.instrs.get(name)
        if ins is None or name == key or ins.opcode == "parameter":
            return 0.0
        users = mod.users.get(name, [])
        if not users:
            return 0.0
        if mod.produces_bf16_data(ins):
            if not all(mod.contracts(u) for u in users):
                return 0.0
            return 1.0 if mod.upcasts_a_bf16_buffer(ins) else 0.5
        if not (
            _dtype(ins.shape) == "f32" and mod.contracts(ins)
            and all(mod.consumes_as_bf16(u, name) for u in users)
        ):  # fmt: skip
            return 0.0
        return 1.0 if all(mod.is_one_convert(u) for u in users) else 0.5

    ranges = [(k, int(a), int(b)) for k, a, b in _RANGE_RE.findall(live)]
    end = max((b for _, _, b in ranges), default=0) + 2
    both, kept = np.zeros(end), np.zeros(end)
    for key, a, b in ranges:
        size = sizes.get(key, 0)
        for curve, n in ((both, size), (kept, size * (1.0 - extra(key)))):
            curve[a] += n
            curve[b + 1] -= n
    return {
        "live_peak": int(np.cumsum(both).max(initial=0)),
        "live_peak_less_f32_copies": int(np.cumsum(kept).max(initial=0)),
    }


# Ops a device does not launch as a kernel of its own (no memory traffic of their own, or
# a control op whose computations are counted), and the collectives (priced apart).
_NOT_KERNELS = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "all-reduce-start", "all-reduce-done", "all-gather-start", "all-gather-done",
    "collective-permute-start", "collective-permute-done", "async-start", "async-done",
}  # fmt: skip
_DIMS_RE = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")
_LABELS_RE = re.compile(r"dim_labels=\w+_(\w+)->")


def _dims(shape: str) -> tuple[int, ...]:
    m = re.search(r"\[([\d,]*)\]", shape)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _contraction_flops(mod: HloModule, ins) -> float:
    """2 x multiply-adds of a dot or convolution (0 for other ops)."""
    out = float(np.prod(_dims(ins.shape)))
    shape = lambda i: mod.instrs[_name(ins.operands[i])].shape  # noqa: E731
    if ins.opcode == "dot":
        m = _DIMS_RE.search(ins.attrs)
        lhs = _dims(shape(0))
        k = np.prod([lhs[int(d)] for d in m.group(1).split(",") if d]) if m else 1
        return 2.0 * out * float(k)
    if ins.opcode == "convolution":
        rhs = _dims(shape(1))
        labels = _LABELS_RE.search(ins.attrs)
        o = labels.group(1).index("o") if labels else len(rhs) - 1
        return 2.0 * out * float(np.prod(rhs)) / max(rhs[o], 1)
    return 0.0


def kernels(mod: HloModule) -> list[tuple[float, float, int]]:
    """(flops, bytes, times run) of each kernel of the program: every op of the entry
    computation and of the loops' and branches' bodies, a fusion as one kernel (the dots
    and convolutions inside it give its flops); bytes are its operands' and its result's.
    A GPU runs these one after another, each at its own roofline, which is what
    `price`'s per-kernel figure sums (the whole-program roofline, max(all flops, all
    bytes), lets a memory-bound optimizer update hide behind the matmuls)."""
    fused = set()
    for ins in mod.instrs.values():
        if ins.opcode == "fusion":
            fused.add(mod._fused(ins))
    reducers = {m for ins in mod.instrs.values() for m in _TO_APPLY_RE.findall(ins.attrs)}
    out = []
    for comp, instrs in mod.comp_instrs.items():
        if comp in fused or comp in reducers or comp not in mod.mult:
            continue
        for ins in instrs:
            if ins.opcode in _NOT_KERNELS:
                continue
            nbytes = shape_bytes(ins.shape) + sum(
                shape_bytes(mod.instrs[_name(o)].shape)
                for o in ins.operands
                if _name(o) in mod.instrs
            )
            if ins.opcode == "fusion":
                inner = mod.comp_instrs.get(mod._fused(ins), [])
                flops = sum(_contraction_flops(mod, i) for i in inner)
            else:
                flops = _contraction_flops(mod, ins)
            out.append((flops, float(nbytes), mod.mult[comp]))
    return out


def measure(
    compiled,
    mesh,
    compile_s: float = 0.0,
    correct_bf16: bool = True,
    dump_dir: str | None = None,
) -> Measured:
    """Read collectives, flops, bytes and memory from a compiled program on ``mesh``.
    With the ``dump_dir`` it was compiled with, memory also gets ``less_f32_copies``:
    the total less what the CPU's f32 copies of bf16 data add to XLA's live peak."""
    text = compiled.as_text()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    prof = cost_models.load("h100-sxm")  # only devices_per_node matters for the tier
    info = mesh_info(mesh, prof.devices_per_node)
    mod = HloModule(text)
    memory = compiled_memory(compiled.memory_analysis())
    if dump_dir is not None:
        peaks = f32_copies_at_peak(dump_dir, mod)
        copies = peaks["live_peak"] - peaks["live_peak_less_f32_copies"]
        memory.update(peaks, less_f32_copies=memory["total"] - copies)
    out = Measured(
        compile_s=compile_s,
        flops=float(ca.get("flops", 0.0)),
        bytes_accessed=float(ca.get("bytes accessed", 0.0)),
        memory=memory,
        unknown_trip_loops=mod.unknown_trip_loops,
        kernels=kernels(mod),
    )
    all_axes = tuple(a for a, s in zip(info.axis_names, info.axis_sizes) if s > 1)
    for hc in parse_collectives(text, mesh):
        ins = mod.instrs.get(hc.name)
        axes = hc.axes if hc.axes is not None else all_axes  # unmatched: slowest, all
        mult = mod.mult.get(ins.computation, 1) if ins is not None else 1
        out.in_loop += int(hc.in_loop)
        if ins is None:
            out.collectives.append(
                Coll(
                    hc.kind,
                    hc.kind,
                    hc.bytes,
                    hc.bytes,
                    hc.dtype,
                    axes,
                    hc.axes is not None,
                    info.is_intra_node(axes),
                    mult,
                    False,
                    hc.name,
                )  # fmt: skip
            )
            continue
        elems = _tuple_elems(ins.shape)
        promoted = False
        if hc.kind == "all-reduce":
            m = _TO_APPLY_RE.search(ins.attrs)
            promoted = bool(m and "promoted" in m.group(1))
        # Split the instruction's bytes over its elements (all-gather: result side).
        if len(elems) > 1:
            sizes = [shape_bytes(e) for e in elems]
            scale = hc.bytes / max(sum(sizes), 1)
            parts = [
                (i, s * scale, _dtype(e), ins.operands[i] if i < len(ins.operands) else None)
                for i, (s, e) in enumerate(zip(sizes, elems))
            ]
        else:
            parts = [(None, hc.bytes, hc.dtype, ins.operands[0] if ins.operands else None)]
        groups: dict[tuple[str, bool], list[float]] = {}
        for index, nbytes, dtype, operand in parts:
            kind = hc.kind
            names = mod.element_name(ins, index)
            users = [(nm, u) for nm in names for u in mod.users.get(nm, [])]
            if (
                kind == "all-reduce"
                and hc.group_size > 1
                and mod.only_sliced(names, nbytes, hc.group_size)
            ):
                kind = "reduce-scatter"
                out.reclassified_rs += 1
            upcast = False
            if correct_bf16 and dtype == "f32":
                src = mod.instrs.get(_name(operand)) if operand else None
                upcast = (
                    promoted
                    or mod.produces_bf16_data(src)
                    or (bool(users) and all(mod.consumes_as_bf16(u, nm) for nm, u in users))
                )
            if upcast:
                out.upcast_bytes += nbytes / 2 * mult
                nbytes = nbytes / 2
            groups.setdefault((kind, upcast), []).append(nbytes)
        for (kind, upcast), sizes in groups.items():
            out.collectives.append(
                Coll(
                    kind,
                    hc.kind,
                    float(sum(sizes)),
                    hc.bytes,
                    "bf16" if upcast else hc.dtype,
                    tuple(axes),
                    hc.axes is not None,
                    info.is_intra_node(axes),
                    mult,
                    upcast,
                    hc.name,
                )
            )
    return out


@dataclass
class Priced:
    compute_s: float
    comm_s: float
    comm_s_by_axis: dict[str, float]
    step_no_overlap_s: float
    step_overlap_s: float
    # the roofline per kernel, summed (secondary: see `kernels`), and with communication
    compute_kernels_s: float = float("nan")
    step_kernels_s: float = float("nan")

    def to_json(self) -> dict:
        return asdict(self)


def dot_rate(profile, dtype):
    """The rate a program's contractions in `dtype` run at on `profile`: float32 dots at
    the rate JAX's default matmul precision picks (`autopar.cost.model.default_f32_rate`:
    TF32 on tensor cores where the profile has a `tfloat32` peak), others at `dtype`'s.
    The compiled text does not say which precision a dot asked for, so a step that asks
    for HIGHEST itself is priced as if it had not."""
    if np.dtype(dtype) != np.float32:
        return dtype
    rate = default_f32_rate()
    return rate if rate in profile.peak_flops else dtype


def price(m: Measured, profile, mesh, dtype) -> Priced:
    """Seconds on ``profile`` (a cost_models name or ClusterProfile) for a measured program:
    its contraction FLOPs (`kernels`) at `dot_rate`, its other FLOPs at `dtype`'s rate,
    against its bytes (the whole-program roofline), and kernel by kernel."""
    prof = cost_models.load(profile)
    info = mesh_info(mesh, prof.devices_per_node)
    cm = CostModel(prof, info)
    rate = dot_rate(prof, dtype)
    dots = sum(f * k for f, _, k in m.kernels)
    compute = max(
        cm.compute_seconds(dots, 0.0, rate)
        + cm.compute_seconds(max(m.flops - dots, 0.0), 0.0, dtype),
        cm.compute_seconds(0.0, m.bytes_accessed, dtype),
    )
    per_kernel = sum(cm.compute_seconds(f, b, rate) * k for f, b, k in m.kernels)
    by_axis: dict[str, float] = {}
    comm = 0.0
    for c in m.collectives:
        # link time only: the copies XLA puts around an all-to-all are kernels of the
        # program, priced with its compute
        s = cm.collective(c.kind, c.axes, c.bytes, copies=False).seconds * c.mult
        key = ",".join(c.axes)
        by_axis[key] = by_axis.get(key, 0.0) + s
        comm += s
    return Priced(
        compute,
        comm,
        dict(sorted(by_axis.items())),
        compute + comm,
        max(compute, comm),
        per_kernel,
        per_kernel + comm,
    )
