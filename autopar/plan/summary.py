"""A plan as text: the summary `Plan.summary` prints (mesh, cost, pipeline, candidates,
notes) and the full listing `str(plan)` adds (inputs, outputs, the main ops)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.errors import format_bytes
from autopar.ir.ops import CONTRACTIONS
from autopar.passes.roll import SCOPE as ROLL_SCOPE
from autopar.plan.plan import is_note
from autopar.plan.schedule import schedule_line, timeline

if TYPE_CHECKING:
    from autopar.plan.plan import Plan


def summary(plan: Plan) -> str:
    c = plan.cost
    axes = " x ".join(f"{a}={s}" for a, s in zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    lines = [
        f"autopar plan for {plan.function or 'function'} on mesh {axes} ({plan.cluster.get('name', '?')}), "
        f"engine {plan.engine}"
        + (
            f", planned in {plan.phases['total']:.2f} s"
            if plan.phases and "total" in plan.phases
            else f", searched in {plan.search_seconds:.2f} s"
            if plan.search_seconds
            else ""
        ),
        f"  predicted step {c.step_s * 1e3:.3f} ms = compute {c.compute_s * 1e3:.3f} ms + comm {c.comm_s * 1e3:.3f} ms; "
        f"peak memory {format_bytes(c.peak_memory_bytes)}/device (arguments {format_bytes(c.argument_bytes)})",
    ]
    replicated = plan.replicated_share()
    if replicated is not None and plan.mesh.num_devices > 1:
        lines.append(
            f"  work: {100 * (1 - replicated):.0f}% of the ops' compute split over devices, "
            f"{100 * replicated:.0f}% replicated (run whole on every device)"
        )
    if plan.phases:
        lines.append("  time: " + _phase_line(plan.phases))
    if plan.worker_phases:
        lines.append(
            "  side by side, in the workers (overlapping): "
            + ", ".join(
                f"{k} {v:.2f} s"
                for k, v in sorted(plan.worker_phases.items(), key=lambda kv: -kv[1])
                if v >= 0.005
            )
        )
    if plan.cache:
        c2 = plan.cache
        lines.append(
            f"  plan cache: {c2.get('status')}"
            + (
                f" (the search it saved took {c2['searched_s']:.2f} s)"
                if c2.get("searched_s")
                else ""
            )
            + (f", {c2['path']}" if c2.get("path") else "")
        )
    if plan.compiled_memory_bytes is not None:
        lines.append(f"  compiled by XLA: {format_bytes(plan.compiled_memory_bytes)}/device")
    for k, b in sorted(c.comm_bytes.items()):
        lines.append(f"  {k:<28} {format_bytes(b)}")
    if plan.candidates:
        lines.append(
            "  candidates: "
            + ", ".join(
                f"{k} {v.step_s * 1e3:.3f} ms/{format_bytes(v.peak_memory_bytes)}"
                for k, v in plan.candidates.items()
            )
        )
    if plan.grad_accumulation:
        lines.append(
            f"  gradient accumulation: {plan.grad_accumulation} micro-batches a step "
            "(the grad_accumulation/scan op)"
        )
    if plan.pipeline:
        p = plan.pipeline
        lines.append(
            f"  pipeline: {p['stages']} stages over '{p['axis']}', {p['microbatches']} micro-batches, "
            f"{p['schedule']}"
            + "".join(
                f" ({_loop_pair(f)} interleaved, {len(f['head'])} head ops on the last stage)"
                for f in p.get("fused", ())
            )
            + "; "
            + (
                f"{p['virtual_stages']} virtual stages each (virtual stage u on stage u mod S); "
                if p.get("virtual_stages", 1) > 1
                else ""
            )
            + "; ".join(
                f"{s['op']}: layers " + " | ".join(f"{a}-{b - 1}" for a, b in s["stages"])
                for s in p["scans"]
            )
        )
        lines.append("  " + schedule_line(timeline(p)))
        for f in p.get("fused", ()):
            if "moved_seconds" in f:  # interleaved: the weights in chunk order
                lines.append(
                    f"  interleaving moves the loops' per-layer inputs into chunk order "
                    f"and their gradients back: {f['moved_seconds'] * 1e3:.4g} ms of "
                    f"collective-permutes a step, {f['moved_bytes'] / 2**20:.4g} MiB/device "
                    "held"
                )
    for name, info in plan.search_info.items():
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
        if info.get("polished_s"):
            notes.append(
                f"{'then ' if notes else ''}polished {info['polished_s'] * 1e6:.1f} µs "
                "faster with all-reduces combined"
            )
        if info.get("lean_arguments_bytes"):
            notes.append(
                f"arguments {format_bytes(info['lean_arguments_bytes'])} smaller per device "
                "at the same price"
            )
        lines.append(f"  {name}: " + "; ".join(notes))
    for w in plan.warnings:
        lines.append(f"  {'note' if is_note(w) else 'warning'}: {w}")
    return "\n".join(lines)


def text(plan: Plan) -> str:
    lines = [summary(plan), "", "inputs:"]
    width = max((len(r.path) for r in plan.inputs + plan.outputs), default=10)
    for r in plan.inputs:
        lines.append(f"  {r.path:<{width}}  {r.dtype}{list(r.shape)}  {r.spec}")
    lines.append("outputs:")
    for r in plan.outputs:
        lines.append(f"  {r.path:<{width}}  {r.dtype}{list(r.shape)}  {r.spec}")
    lines.append("ops (contractions and gathers; `autopar inspect --by op` lists all):")
    lines += _op_lines(plan.ops, "  ")
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
