"""The pipeline schedule a plan runs, slot by slot: which micro-batch each stage works
on in every slot of the lowered program (`autopar.lower.pipeline`), and what is idle.
`autopar inspect` prints it, `autopar render` draws it, `Plan.summary` gives its
bubble. It is read from the plan's `pipeline` record alone.

The slots are the lowering's, in order:

* a loop pipelined on its own (GPipe, or a loop no backward loop pairs with):
  `M + S - 1` slots; in slot `i` stage `s` runs micro-batch `i - s` (a reversed
  loop, a backward pass: `i - (S - 1 - s)`); a stage with no micro-batch in a slot
  computes on zeros and drops the result (idle).
* a 1F1B pair (`fused`): `S - 1` forward slots, then `M` ticks of a forward slot, the
  head on the last stage (the other stages wait) and a backward slot, then `S - 1`
  backward slots; the forward slot `i` runs micro-batch `i - s`, the backward slot `b`
  micro-batch `b - (S - 1 - s)`.
* an alternating 1F1B pair (schedule "1f1b-async"): `2 (M + S - 1)` half-slots; in
  half-slot `t` stage `s` runs the forward pass of micro-batch `(t - s) / 2` where
  `t - s` is even, else the backward pass of micro-batch `(t - 2S + 1 + s) / 2`; a
  half-slot lasts its slowest stage's pass, the others wait (idle); after a
  half-slot in which the last stage ran a forward pass, the head on the last stage
  (the other stages wait).
* a zero-bubble pair (schedule "zb-h1"): the 1F1B pair's slots, each backward slot the
  input gradient only, and from backward slot `S - 1` on a weight-gradient slot after
  each backward slot `t`, in which every stage runs the weight gradients of
  micro-batch `t - (S - 1)` (stage `s`'s own `s` slots after its backward pass);
  a micro-batch's activations are held until its weight gradients
  (`pipeline.fused[].weight_seconds`: one weight-gradient slot).
* an interleaved pair (schedule "interleaved", `v` virtual stages): `M v + S - 1`
  forward slots of one chunk of a stage's layers, the backward ones `v S - 1` slots
  behind; in slot `t` stage `s` runs forward pass `t - s` and backward pass
  `t - (v S - 1) - (S - 1 - s)`, pass `j` being micro-batch `g S + r` through chunk
  `c` for `j = g S v + c S + r` (chunks reversed for backward passes); the head
  after the forward slots in which the last stage finished a micro-batch's last chunk.

Every slot is lock-step: all stages start it together. A slot lasts the priced time
of its loop over its `M + S - 1` slots, `M v + S - 1` interleaved (the plan records
each pipelined loop's price, `seconds`, and the head's, `head_seconds`, over all
micro-batches); a plan file without them gets unit slots (forward 1, backward 2,
head 0) and says so (`Timeline.estimated`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.passes.interleave import interleaved_pass

__all__ = ["Slot", "Timeline", "schedule_line", "timeline"]

FORWARD, BACKWARD, HEAD, IDLE = "forward", "backward", "head", "idle"
WEIGHT = "weight"  # ZB-H1: a micro-batch's weight gradients, deferred from its backward


@dataclass(frozen=True)
class Slot:
    stage: int
    start: float  # seconds from the first pipelined slot
    seconds: float
    kind: str  # FORWARD, BACKWARD, HEAD or IDLE
    micro: int | None  # the micro-batch, None when idle
    loop: str  # the op key of the loop (or head) the slot belongs to
    chunk: int | None = None  # interleaved: the chunk of the stage's layers

    @property
    def label(self) -> str:
        """`F3` forward of micro-batch 3, `B3` its backward, `H3` the head, `W3` its
        deferred weight gradients (ZB-H1), `F3.1` its forward through chunk 1
        (interleaved), `.` idle."""
        if self.micro is None:
            return "."
        tail = "" if self.chunk is None else f".{self.chunk}"
        return f"{self.kind[0].upper()}{self.micro}{tail}"


@dataclass(frozen=True)
class Timeline:
    stages: int
    microbatches: int
    schedule: str
    slots: tuple[Slot, ...]
    seconds: float  # the pipelined part of the step, end to end
    estimated: bool  # unit slot times (the plan records no prices)
    virtual: int = 1  # chunks of layers per stage (the interleaved schedule)

    @property
    def bubble(self) -> float:
        """The fraction of stage-seconds spent idle (filling, draining, waiting)."""
        idle = sum(s.seconds for s in self.slots if s.kind == IDLE)
        return idle / (self.stages * self.seconds) if self.seconds else 0.0

    def in_flight(self, stage: int) -> int:
        """The most micro-batches whose forward slot ran on `stage` and whose backward
        slot has not yet: how many micro-batches' saved activations it holds at once
        (interleaved: micro-batch chunks, each 1/v of a stage's)."""
        live = peak = 0
        # under ZB-H1 a micro-batch's activations stay until its weight gradients
        frees = WEIGHT if any(s.kind == WEIGHT for s in self.slots) else BACKWARD
        for s in sorted(
            (s for s in self.slots if s.stage == stage and s.micro is not None),
            key=lambda s: s.start,
        ):
            live += {FORWARD: 1, frees: -1}.get(s.kind, 0)
            peak = max(peak, live)
        return peak

    def rows(self, width: int = 96) -> list[str]:
        """One line per stage: the slots' labels (`Slot.label`) in order, each as wide
        as its label (no time scale)."""
        lines = []
        for st in range(self.stages):
            text = " ".join(s.label for s in self.slots if s.stage == st)
            if len(text) > width:
                text = text[: width - 3] + "..."
            lines.append(f"stage {st}: {text}")
        return lines


def timeline(pipeline: dict) -> Timeline:
    """The slots of the plan's `pipeline` record (`Plan.pipeline`)."""
    S, M = int(pipeline["stages"]), int(pipeline["microbatches"])
    fused = {f["forward"]: f for f in pipeline.get("fused", ())}
    backward_of_fused = {f["backward"] for f in pipeline.get("fused", ())}
    scans = {s["op"]: s for s in pipeline["scans"]}
    estimated = any("seconds" not in s for s in pipeline["scans"])
    V = int(pipeline.get("virtual_stages", 1))
    ticks = M * V + S - 1

    def slot_s(scan: dict, reverse: bool) -> float:
        if estimated:
            return 2.0 if reverse else 1.0
        return float(scan["seconds"]) / ticks

    slots: list[Slot] = []
    t = 0.0

    def run(kind: str, seconds: float, micro_of, loop: str) -> None:
        nonlocal t
        for s in range(S):
            m, c = micro_of(s), None
            if isinstance(m, tuple):
                m, c = m
            ok = m is not None and 0 <= m < M
            kind_s, m_s, c_s = (kind, m, c) if ok else (IDLE, None, None)
            slots.append(Slot(s, t, seconds, kind_s, m_s, loop, c_s))
        t += seconds

    alternating = pipeline.get("schedule") == "1f1b-async"
    for scan in pipeline["scans"]:
        op = scan["op"]
        if op in backward_of_fused:
            continue
        if op in fused and alternating:
            f = fused[op]
            tf, tb = slot_s(scan, False), slot_s(scans[f["backward"]], True)
            th = 0.0 if estimated else float(f.get("head_seconds", 0.0)) / M
            for half in range(2 * ticks):
                t += _alternating_half(slots, half, t, S, M, (tf, tb), (op, f["backward"]))
                m = (half - (S - 1)) // 2
                if th and (half - S + 1) % 2 == 0 and 0 <= m < M:
                    run(HEAD, th, lambda s, m=m: m if s == S - 1 else None, "head")
        elif op in fused and V > 1:
            f = fused[op]
            tf, tb = slot_s(scan, False), slot_s(scans[f["backward"]], True)
            th = 0.0 if estimated else float(f.get("head_seconds", 0.0)) / M
            _interleaved(run, S, M, V, (tf, tb, th), (op, f["backward"]))
        elif op in fused:
            f = fused[op]
            back = scans[f["backward"]]
            tf, tb = slot_s(scan, False), slot_s(back, True)
            th = 0.0 if estimated else float(f.get("head_seconds", 0.0)) / M
            # ZB-H1: a backward slot is the input gradient; the weight gradients of
            # micro-batch `t - (S - 1)` follow backward slot `t` from slot S - 1 on
            # (the loop's price: M + S - 1 input-gradient slots and M weight-gradient ones)
            zb = pipeline.get("schedule") == "zb-h1"
            tw = (0.5 * tb if estimated else float(f.get("weight_seconds", 0.0))) if zb else 0.0
            tb = tb - tw if estimated else (float(back["seconds"]) - M * tw) / ticks

            def weights(t: int, zb=zb, tw=tw, loop=f["backward"]) -> None:
                if zb and t >= S - 1:
                    run(WEIGHT, tw, lambda s, t=t: t - (S - 1), loop)

            for i in range(S - 1):
                run(FORWARD, tf, lambda s, i=i: i - s, op)
            for j in range(M):
                run(FORWARD, tf, lambda s, j=j: S - 1 + j - s, op)
                if th:
                    run(HEAD, th, lambda s, j=j: j if s == S - 1 else None, "head")
                run(BACKWARD, tb, lambda s, j=j: j - (S - 1 - s), f["backward"])
                weights(j)
            for k in range(S - 1):
                run(BACKWARD, tb, lambda s, k=k: M + k - (S - 1 - s), f["backward"])
                weights(M + k)
        else:
            reverse = bool(scan.get("reverse", False))
            kind, ts = (BACKWARD if reverse else FORWARD), slot_s(scan, reverse)
            for i in range(ticks):
                run(kind, ts, lambda s, i=i, r=reverse: i - (S - 1 - s) if r else i - s, op)
    return Timeline(S, M, str(pipeline.get("schedule", "")), tuple(slots), t, estimated, V)


def _interleaved(run, S: int, M: int, V: int, times, loops) -> None:
    """The interleaved pair's slots (module doc), appended through `run`."""
    tf, tb, th = times
    D, T = V * S - 1, M * V + S - 1

    def job(j: int, back: bool):
        return interleaved_pass(j, S, V, back) if 0 <= j < M * V else None

    for i in range(T + D):
        if i < T:
            run(FORWARD, tf, lambda s, i=i: job(i - s, False), loops[0])
            last = job(i - (S - 1), False)
            if th and last is not None and last[1] == V - 1:
                run(HEAD, th, lambda s, m=last[0]: m if s == S - 1 else None, "head")
        if i >= D:
            run(BACKWARD, tb, lambda s, i=i: job(i - D - (S - 1 - s), True), loops[1])


def _alternating_half(
    slots: list[Slot], half: int, start: float, S: int, M: int, times, loops
) -> float:
    """Half-slot `half` of the alternating 1F1B schedule appended to `slots` (each
    stage's pass, then idle to the slowest one's end); its length. `times`: forward and
    backward seconds per micro-batch; `loops`: the two loops' keys."""
    length = 0.0
    for s in range(S):
        fwd = (half - s) % 2 == 0
        m = (half - s) // 2 if fwd else (half - (2 * S - 1 - s)) // 2
        if 0 <= m < M:
            slot = Slot(s, start, times[1 - fwd], FORWARD if fwd else BACKWARD, m, loops[1 - fwd])
            slots.append(slot)
            length = max(length, slot.seconds)
    for s in range(S):
        used = max((x.seconds for x in slots if x.stage == s and x.start == start), default=0.0)
        if length > used:
            slots.append(Slot(s, start + used, length - used, IDLE, None, loops[0]))
    return length


def schedule_line(t: Timeline) -> str:
    """One line for `Plan.summary`: the schedule, its pipelined time and bubble, and how
    many micro-batches' activations each stage holds at once."""
    name = {
        "1f1b": "lock-step 1F1B",
        "gpipe": "GPipe",
        "1f1b-async": "alternating 1F1B",
        "zb-h1": "zero-bubble 1F1B (ZB-H1)",
        "interleaved": "interleaved 1F1B",
    }.get(t.schedule, t.schedule)
    held = ", ".join(str(t.in_flight(s)) for s in range(t.stages))
    span = (
        "unit slot times (the plan records no prices)"
        if t.estimated
        else (f"{t.seconds * 1e3:.4g} ms pipelined")
    )
    chunks = f" x {t.virtual} virtual stages" if t.virtual > 1 else ""
    held_what = "micro-batch chunks" if t.virtual > 1 else "micro-batches"
    return (
        f"schedule: {name}, {t.stages} stages{chunks} x {t.microbatches} "
        f"micro-batches, {span}, bubble {t.bubble:.0%} of the stages' time; {held_what} "
        f"held per stage: {held}"
    )
