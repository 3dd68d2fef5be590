"""`autopar.Plan`: the result of a search, and the plan file (`autopar.plan/1`, JSON)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar.cost.model import Cost
from autopar.errors import PlanError, format_bytes
from autopar.ir.graph import Graph
from autopar.ir.ops import CONTRACTIONS
from autopar.meshes import stage_meshes
from autopar.passes.roll import SCOPE as ROLL_SCOPE
from autopar.plan.records import OpRecord, TensorRecord
from autopar.plan.schedule import schedule_line, timeline
from autopar.sharding import MeshInfo

FORMAT = "autopar.plan/1"

# Plan warnings that only inform (what a pass did, what an "auto" option tried, what
# was reused): shown as `note:`, the rest as `warning:`.
_NOTE_RE = re.compile(
    r"^(mixed precision: |remat \(\w+\): (the backward loop|layer stack)|remat='auto' tried|"
    r"layer stack: |mesh-shape search over |"
    r"\{[^}]*\}[^:]*: \S+ ms as priced with its layers in one loop|"
    r"pipeline_stages='auto' tried|partial reuse of a plan|interleaved 1F1B, \d+ virtual stages|"
    r"\d+ of \d+ \(mesh, micro-batch count\) tries not searched|"
    r"gradient accumulation: \d+ statistics? of the batch alone)"
)


def is_note(text: str) -> bool:
    """Whether a plan warning is informational (printed as `note:`)."""
    return bool(_NOTE_RE.match(text))


def _records(rows: list | None) -> tuple[TensorRecord, ...] | None:
    return None if rows is None else tuple(TensorRecord.from_json(r) for r in rows)


def fingerprint(graph: Graph) -> str:
    """Hash of what a plan depends on: arg/result paths and types, and the op sequence
    (scan bodies included)."""
    h = hashlib.sha256()
    for p, v in zip(graph.input_paths, graph.inputs):
        h.update(f"in {p} {graph.values[v]}\n".encode())
    for p, v in zip(graph.output_paths, graph.outputs):
        h.update(f"out {p} {graph.values[v]}\n".encode())
    for n in graph.nodes:
        ins = ",".join(str(graph.values[v]) for v in n.inputs)
        outs = ",".join(str(graph.values[v]) for v in n.outputs)
        h.update(f"{n.op}({ins})->{outs}\n".encode())
        if n.body is not None:
            h.update(f"body {fingerprint(n.body)}\n".encode())
        for b in n.branches or ():
            h.update(f"branch {fingerprint(b)}\n".encode())
    return h.hexdigest()[:16]


def op_keys(graph: Graph) -> list[str]:
    seen: dict[str, int] = {}
    keys = []
    for n in graph.nodes:
        base = f"{n.name_stack}/{n.op}" if n.name_stack else n.op
        i = seen.get(base, 0)
        seen[base] = i + 1
        keys.append(f"{base}#{i}")
    return keys


@dataclass(frozen=True, eq=False)
class Plan:
    """A sharding strategy for every input, output and op of one function."""

    fingerprint: str
    mesh: MeshInfo
    cluster: dict
    engine: str
    search_seconds: float
    inputs: tuple[TensorRecord, ...]
    outputs: tuple[TensorRecord, ...]
    ops: tuple[OpRecord, ...]
    cost: Cost
    warnings: tuple[str, ...] = ()
    candidates: dict[str, Cost] = field(default_factory=dict)
    function: str = ""
    compiled_memory_bytes: int | None = None  # XLA's figure, when the plan was compiled to check it
    search_info: dict = field(default_factory=dict)  # per engine: optimal, gap (dp / ilp)
    # pipelined scans: stages, microbatches, schedule, axis, and per scan op its key and
    # the layer range of every stage (`autopar.passes.pipeline`); None when not pipelined
    pipeline: dict | None = None
    # "bfloat16": contractions compute in it over float32 master weights (`autopar.passes.precision`)
    precision: str | None = None
    # micro-batches of the gradient accumulation loop (`autopar.passes.accumulate`), or None
    grad_accumulation: int | None = None
    # the rematerialization policy applied before search ("dots", "selective", "full"), or None
    remat: str | None = None
    # of a stack of layers unrolled in Python, how many (the first ones) `remat` covers;
    # None: all of them (or no such stack)
    remat_layers: int | None = None
    # the per-device memory budget the plan was searched under (bytes)
    memory_budget: float | None = None
    # the positional arguments the step donates (`donate_argnums`), whose buffers the
    # predicted peak reuses for the results; None: not recorded (a file written before)
    donate_argnums: tuple[int, ...] | None = None
    # where such a stack is rolled into a pipeline, `inputs` are the rolled program's
    # (a group per layer slot); these are the function's own leaves, each layer's on its
    # stage (`TensorRecord.stage`): what `in_specs` and `in_shardings` give
    user_inputs: tuple[TensorRecord, ...] | None = None
    user_outputs: tuple[TensorRecord, ...] | None = None  # the same for the results
    # wall seconds of each phase of the `.plan()` call that made this plan ("capture",
    # "build", one per engine, "polish", "compile check", ..., "other", "total"; see
    # `autopar.compile.clock`); not in the plan file unless `to_json(timings=True)`
    phases: dict | None = field(default=None, compare=False)
    # seconds the search workers spent per phase (`autopar.search.workers`), added up
    # over the workers; they ran during `phases`' "engines" / "screen" / "tries"
    worker_phases: dict | None = field(default=None, compare=False)
    # the plan cache's part ({"status": "hit" | "stored", "path", and on a hit
    # "searched_s": the search the entry came from}); None when the cache is off
    cache: dict | None = field(default=None, compare=False)
    in_tree: Any = field(default=None, repr=False, compare=False)
    out_tree: Any = field(default=None, repr=False, compare=False)
    jax_mesh: Any = field(default=None, repr=False, compare=False)

    # ---- pytrees of specs and shardings -------------------------------------------------
    def _tree(self, tree, records):
        specs = [r.spec.to_pspec() for r in records]
        if tree is None:
            return {r.path: s for r, s in zip(records, specs)}
        return jax.tree_util.tree_unflatten(tree, specs)

    @property
    def in_specs(self):
        """PartitionSpecs shaped like the (non-static) args; a {path: spec} dict when the
        plan was loaded from a file and not yet bound to a function. A leaf of a layer
        unrolled in Python and pipelined: its spec on its stage's sub-mesh."""
        return self._tree(self.in_tree, self.user_inputs or self.inputs)

    @property
    def out_specs(self):
        return self._tree(self.out_tree, self.user_outputs or self.outputs)

    def _require_devices(self) -> None:
        if not isinstance(self.jax_mesh, jax.sharding.Mesh):
            raise PlanError(
                "this plan's mesh has no devices (abstract planning); shardings need a concrete jax.sharding.Mesh"
            )

    def _shardings(self, specs):
        self._require_devices()
        return jax.tree_util.tree_map(
            lambda s: NamedSharding(self.jax_mesh, s),
            specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    @property
    def in_shardings(self):
        """Shardings shaped like the (non-static) args; a leaf of a layer unrolled in
        Python and pipelined lives on its stage's devices only (`TensorRecord.stage`)."""
        if self.user_inputs is None:
            return self._shardings(self.in_specs)
        return self._staged(self.in_tree, self.user_inputs)

    @property
    def out_shardings(self):
        if self.user_outputs is None:
            return self._shardings(self.out_specs)
        return self._staged(self.out_tree, self.user_outputs)

    def _staged(self, tree, records):
        """Shardings of `records`, a stage's leaf on that stage's sub-mesh."""
        self._require_devices()
        mesh = self.jax_mesh
        subs = stage_meshes(mesh, self.pipeline["axis"])
        out = [
            NamedSharding(mesh if r.stage is None else subs[r.stage], r.spec.to_pspec())
            for r in records
        ]
        if tree is None:
            return {r.path: sh for r, sh in zip(records, out)}
        return jax.tree_util.tree_unflatten(tree, out)

    # ---- files --------------------------------------------------------------------------
    def to_json(self, timings: bool = False) -> dict:
        """The plan file's content. Timings are left out on purpose (unless `timings`),
        so the same function, arguments, mesh and profile give a byte-identical file."""
        d = {
            "format": FORMAT,
            "function": self.function,
            "fingerprint": self.fingerprint,
            "mesh": self.mesh.to_json(),
            "cluster": self.cluster,
            "engine": self.engine,
            "cost": self.cost.to_json(),
            "candidates": {k: v.to_json() for k, v in self.candidates.items()},
            "inputs": [r.to_json() for r in self.inputs],
            "outputs": [r.to_json() for r in self.outputs],
            "ops": [o.to_json() for o in self.ops],
            "warnings": list(self.warnings),
            "compiled_memory_bytes": self.compiled_memory_bytes,
            "search_info": self.search_info,
            "pipeline": self.pipeline,
            "precision": self.precision,
            "grad_accumulation": self.grad_accumulation,
            "remat": self.remat,
        }
        if self.remat_layers is not None:
            d["remat_layers"] = self.remat_layers
        if self.memory_budget is not None:
            d["memory_budget"] = self.memory_budget
        if self.donate_argnums is not None:
            d["donate_argnums"] = list(self.donate_argnums)
        for key in ("user_inputs", "user_outputs"):
            if getattr(self, key) is not None:
                d[key] = [r.to_json() for r in getattr(self, key)]
        if timings and self.phases:
            d["phases"] = dict(self.phases)
        if timings and self.worker_phases:
            d["worker_phases"] = dict(self.worker_phases)
        return d

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=False)
            f.write("\n")

    @staticmethod
    def from_json(d: dict, where: str = "plan") -> Plan:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise PlanError(f"{where}: not an {FORMAT} file (format: {got!r})")
        try:
            m = d["mesh"]
            mesh = MeshInfo.build(
                list(m["axes"]),
                list(m["axes"].values()),
                m["device_ids"],
                int(d["cluster"]["devices_per_node"]),
            )
            return Plan(
                fingerprint=d["fingerprint"],
                mesh=mesh,
                cluster=d["cluster"],
                engine=d["engine"],
                search_seconds=float(d.get("search_seconds", 0.0)),
                inputs=tuple(TensorRecord.from_json(r) for r in d["inputs"]),
                outputs=tuple(TensorRecord.from_json(r) for r in d["outputs"]),
                ops=tuple(OpRecord.from_json(o) for o in d["ops"]),
                cost=Cost.from_json(d["cost"]),
                warnings=tuple(d.get("warnings", ())),
                candidates={k: Cost.from_json(v) for k, v in d.get("candidates", {}).items()},
                function=d.get("function", ""),
                compiled_memory_bytes=d.get("compiled_memory_bytes"),
                search_info=dict(d.get("search_info", {})),
                pipeline=d.get("pipeline"),
                precision=d.get("precision"),
                grad_accumulation=d.get("grad_accumulation"),
                remat=d.get("remat"),
                remat_layers=d.get("remat_layers"),
                memory_budget=d.get("memory_budget"),
                donate_argnums=(
                    tuple(d["donate_argnums"]) if d.get("donate_argnums") is not None else None
                ),
                user_inputs=_records(d.get("user_inputs")),
                user_outputs=_records(d.get("user_outputs")),
                phases=d.get("phases"),
                worker_phases=d.get("worker_phases"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{where}: malformed plan file ({type(e).__name__}: {e})") from None

    @staticmethod
    def load(path: str | os.PathLike) -> Plan:
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise PlanError(f"plan file {path} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(
                f"plan file {path} is not valid JSON (truncated or corrupted?): {e}"
            ) from None
        return Plan.from_json(d, str(path))

    # ---- display ------------------------------------------------------------------------
    def replicated_share(self) -> float | None:
        """The share of the ops' compute that runs replicated: ops whose result is
        neither split nor a partial sum over any mesh axis, each op weighted by its
        whole work (its predicted time per device x the devices it is split over). A
        loop's or a cond's work is its body's (branches') ops', scaled to the loop's
        time; a pipelined loop's ops are split over the stages too. None when no op
        takes time. A plan can be mostly replicated and still the fastest (a small
        model, where collectives cost more than the work they split): the summary says
        so, rather than leave the user to find out."""
        piped = {s["op"] for s in (self.pipeline or {}).get("scans", ())}
        stages = int((self.pipeline or {}).get("stages", 1))
        total, replicated = self._work(self.ops, piped, stages)
        return replicated / total if total > 0 else None

    def _work(self, ops, piped=frozenset(), stages: int = 1) -> tuple[float, float]:
        """(whole work, replicated work) of `ops`, as `replicated_share` weighs them."""
        total = replicated = 0.0
        for op in ops:
            inner = [op.body] if op.body is not None else list(op.branches or ())
            if inner:
                parts = [self._work(b.ops) for b in inner]
                own = sum(b.cost.step_s for b in inner)  # a step's (a branch's) seconds
                if own <= 0:
                    continue
                scale = op.compute_s / own * (stages if op.key in piped else 1)
                total += scale * sum(t for t, _ in parts)
                replicated += scale * sum(r for _, r in parts) if op.key not in piped else 0.0
                continue
            if not op.out_specs:
                continue
            spec = op.out_specs[0]
            split = math.prod(self.mesh.size(a) for a in {*spec.used_axes, *spec.partial})
            total += op.compute_s * split
            replicated += op.compute_s if split == 1 else 0.0
        return total, replicated

    def _zb(self) -> bool:
        return (self.pipeline or {}).get("schedule") == "zb-h1"

    def summary(self) -> str:
        c = self.cost
        axes = " x ".join(f"{a}={s}" for a, s in zip(self.mesh.axis_names, self.mesh.axis_sizes))
        lines = [
            f"autopar plan for {self.function or 'function'} on mesh {axes} ({self.cluster.get('name', '?')}), "
            f"engine {self.engine}"
            + (
                f", planned in {self.phases['total']:.2f} s"
                if self.phases and "total" in self.phases
                else f", searched in {self.search_seconds:.2f} s"
                if self.search_seconds
                else ""
            ),
            f"  predicted step {c.step_s * 1e3:.3f} ms = compute {c.compute_s * 1e3:.3f} ms + comm {c.comm_s * 1e3:.3f} ms; "
            f"peak memory {format_bytes(c.peak_memory_bytes)}/device (arguments {format_bytes(c.argument_bytes)}"
            + (
                f"; argument {', '.join(map(str, self.donate_argnums))} donated"
                if self.donate_argnums
                else ""
            )
            + ")",
        ]
        replicated = self.replicated_share()
        if replicated is not None and self.mesh.num_devices > 1:
            lines.append(
                f"  work: {100 * (1 - replicated):.0f}% of the ops' compute split over devices, "
                f"{100 * replicated:.0f}% replicated (run whole on every device)"
            )
        if self.phases:
            lines.append("  time: " + _phase_line(self.phases))
        if self.worker_phases:
            lines.append(
                "  side by side, in the workers (overlapping): "
                + ", ".join(
                    f"{k} {v:.2f} s"
                    for k, v in sorted(self.worker_phases.items(), key=lambda kv: -kv[1])
                    if v >= 0.005
                )
            )
        if self.cache:
            c2 = self.cache
            lines.append(
                f"  plan cache: {c2.get('status')}"
                + (
                    f" (the search it saved took {c2['searched_s']:.2f} s)"
                    if c2.get("searched_s")
                    else ""
                )
                + (f", {c2['path']}" if c2.get("path") else "")
            )
        if self.compiled_memory_bytes is not None:
            lines.append(f"  compiled by XLA: {format_bytes(self.compiled_memory_bytes)}/device")
        for k, b in sorted(c.comm_bytes.items()):
            lines.append(f"  {k:<28} {format_bytes(b)}")
        if self.candidates:
            lines.append(
                "  candidates: "
                + ", ".join(
                    f"{k} {v.step_s * 1e3:.3f} ms/{format_bytes(v.peak_memory_bytes)}"
                    for k, v in self.candidates.items()
                )
            )
            mine = self.candidates.get(self.engine)
            if mine is not None and not math.isclose(mine.step_s, c.step_s, rel_tol=1e-9):
                lines.append(  # re-priced under another schedule (ZB-H1), say
                    f"  {self.engine}'s plan as it runs: {c.step_s * 1e3:.3f} ms (its candidate "
                    f"price is the search's{', under lock-step 1F1B' if self._zb() else ''})"
                )
        if self.grad_accumulation:
            lines.append(
                f"  gradient accumulation: {self.grad_accumulation} micro-batches a step "
                "(the grad_accumulation/scan op)"
            )
        if self.pipeline:
            p = self.pipeline
            unit = int((p.get("rolled") or {}).get("period", 1))  # layers an iteration
            lines.append(
                f"  pipeline: {p['stages']} stages over '{p['axis']}', {p['microbatches']} micro-batches, "
                f"{p['schedule']}"
                + "".join(
                    f" ({_loop_pair(f)} interleaved, {len(f['head'])} head ops on the last stage)"
                    for f in p.get("fused", ())
                )
                + "; "
                + (
                    f"{p['virtual_stages']} virtual stages each (virtual stage u on stage "
                    "u mod S); "
                    if p.get("virtual_stages", 1) > 1
                    else ""
                )
                + "; ".join(
                    f"{s['op']}: layers "
                    + " | ".join(f"{a * unit}-{b * unit - 1}" for a, b in s["stages"])
                    for s in p["scans"]
                )
            )
            lines.append("  " + schedule_line(timeline(p)))
            for f in p.get("fused", ()):
                if "moved_seconds" in f and (p.get("rolled") or {}).get("virtual_stages"):
                    lines.append(  # the groups are stored in chunk order (`ir.chunks`)
                        "  interleaving: the rolled layers' leaves are kept in chunk order "
                        "(each stage's chunks on its devices), so no weights move"
                        + (
                            f"; other per-layer inputs moved: {f['moved_seconds'] * 1e3:.4g} "
                            "ms of collective-permutes a step"
                            if f["moved_seconds"]
                            else ""
                        )
                    )
                elif "moved_seconds" in f:  # interleaved: the weights moved into chunk order
                    lines.append(
                        f"  interleaving moves the loops' per-layer inputs into chunk order "
                        f"and their gradients back: {f['moved_seconds'] * 1e3:.4g} ms of "
                        f"collective-permutes a step, {f['moved_bytes'] / 2**20:.4g} MiB/device "
                        "held"
                    )
        for name, info in self.search_info.items():
            if name == "skipped":  # engines `auto` left out, with why
                lines += [f"  {e}: not run ({why})" for e, why in info.items()]
                continue
            if name == "matmul_rates":  # the rate each dtype's contractions are priced at
                rates = ", ".join(f"{k} at {v}" for k, v in info.items())
                lines.append(f"  matmul rates: {rates or 'no contractions'}")
                continue
            gap = info.get("gap")
            notes = []
            if "optimal" in info:
                notes.append(
                    ("proven optimal" if info["optimal"] else "not proven optimal")
                    + " under the cost model"
                    + (f" (gap {gap:.2%})" if isinstance(gap, float) and gap > 0 else "")
                )
            # what the polish and the memory tie-break gained, where it shows: a change
            # under 0.05 µs or 0.1% of the plan's arguments is not worth a line
            if info.get("polished_s", 0.0) >= 5e-8:
                notes.append(
                    f"{'then ' if notes else ''}polished {info['polished_s'] * 1e6:.1f} µs "
                    "faster with all-reduces combined"
                )
            if info.get("lean_arguments_bytes", 0) >= 1e-3 * c.argument_bytes:
                notes.append(
                    f"its plan's arguments made {format_bytes(info['lean_arguments_bytes'])} "
                    "smaller per device at its own price"
                )
            if notes:  # each engine's own search, not a comparison with the plan taken
                lines.append(f"  {name} (its own search): " + "; ".join(notes))
        for w in self.warnings:
            lines.append(f"  {'note' if is_note(w) else 'warning'}: {w}")
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [self.summary(), "", "inputs:"]
        width = max((len(r.path) for r in self.inputs + self.outputs), default=10)
        for r in self.inputs:
            lines.append(f"  {r.path:<{width}}  {r.dtype}{list(r.shape)}  {r.spec}")
        lines.append("outputs:")
        for r in self.outputs:
            lines.append(f"  {r.path:<{width}}  {r.dtype}{list(r.shape)}  {r.spec}")
        lines.append("ops (contractions and gathers; `autopar inspect --by op` lists all):")
        lines += _op_lines(self.ops, "  ")
        return "\n".join(lines)


def _phase_line(phases: dict) -> str:
    """`capture 0.15 s + build 2.31 s + ... = 8.21 s` (the phases add up to the total)."""
    parts = [f"{k} {v:.2f} s" for k, v in phases.items() if k != "total" and v >= 0.005]
    total = phases.get("total")
    return " + ".join(parts or ["0 s"]) + (f" = {total:.2f} s" if total is not None else "")


_SHOWN = (*sorted(CONTRACTIONS), "gather", "scatter-add")


def _op_lines(ops, indent: str) -> list[str]:
    lines = []
    for o in ops:
        if o.op in _SHOWN:
            lines.append(f"{indent}{o.source:<22} {o.op:<20} {o.strategy}")
        elif o.body is not None:
            lines.append(
                f"{indent}{o.source:<22} {o.op:<20} body searched once ({o.body.engine}), "
                f"{o.body.cost.step_s * 1e3:.3f} ms a step:"
            )
            lines += _op_lines(o.body.ops, indent + "  ")
        elif o.branches is not None:
            for k, b in enumerate(o.branches):
                lines.append(
                    f"{indent}{o.source:<22} {o.op:<20} branch {k} ({b.engine}), "
                    f"{b.cost.step_s * 1e3:.3f} ms:"
                )
                lines += _op_lines(b.ops, indent + "  ")
    return lines


def _loop_pair(fused: dict) -> str:
    """The forward and backward loops a 1F1B pipeline interleaves, as the summary names
    them: the user's `scan`s by their keys, the loops autopar rolled an unrolled layer
    stack into as such (their keys name autopar's own scope)."""
    if all(fused[k].startswith(ROLL_SCOPE + "/") for k in ("forward", "backward")):
        return "the rolled layers' forward and backward loops"
    return f"{fused['forward']} and {fused['backward']}"
