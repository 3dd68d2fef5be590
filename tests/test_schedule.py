"""The pipeline schedule read from a plan's `pipeline` record (`autopar.plan.schedule`):
the slots the lowering runs, the bubble and the micro-batches each stage holds."""

from __future__ import annotations

import pytest

from autopar.plan.schedule import BACKWARD, FORWARD, HEAD, IDLE, WEIGHT, schedule_line, timeline


def _record(S: int, M: int, fused: bool, seconds=True, schedule: str = "1f1b") -> dict:
    ticks = M + S - 1
    fwd = {"op": "scan@1", "stages": [], "reverse": False}
    bwd = {"op": "scan@9", "stages": [], "reverse": True}
    if seconds:
        fwd["seconds"], bwd["seconds"] = 1.0 * ticks, 2.0 * ticks  # slots of 1 s and 2 s
    rec = {"stages": S, "microbatches": M, "axis": "stage", "scans": [fwd, bwd]}
    rec["schedule"] = schedule if fused else "gpipe"
    if fused:
        rec["fused"] = [
            {"forward": "scan@1", "backward": "scan@9", "head": ["x"], "head_seconds": 0.5 * M}
        ]
    return rec


def _check_dependencies(t) -> None:
    """Each stage runs every micro-batch's forward and backward once, the backward after
    the forward; a forward starts after the stage before finished it, a backward after
    the stage after finished its own (and, on the last stage, after the head)."""
    end = {}
    for s in t.slots:
        if s.micro is not None:
            key = (s.kind, s.stage, s.micro)
            assert key not in end, key
            end[key] = (s.start, s.start + s.seconds)
    S, M = t.stages, t.microbatches
    for m in range(M):
        for st in range(S):
            f, b = end[(FORWARD, st, m)], end[(BACKWARD, st, m)]
            assert f[1] <= b[0]
            if st:
                assert end[(FORWARD, st - 1, m)][1] <= f[0]
            if st < S - 1:
                assert end[(BACKWARD, st + 1, m)][1] <= b[0]
            elif (HEAD, st, m) in end:
                assert f[1] <= end[(HEAD, st, m)][0] and end[(HEAD, st, m)][1] <= b[0]


@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (4, 2), (3, 1)])
def test_lock_step_1f1b_slots(S, M):
    t = timeline(_record(S, M, fused=True))
    _check_dependencies(t)
    # stage s frees a micro-batch 2 (S - 1 - s) ticks after saving it (autopar.lower.pipeline)
    assert [t.in_flight(s) for s in range(S)] == [min(M, 2 * (S - 1 - s) + 1) for s in range(S)]
    tick, head = 1.0 + 2.0, 0.5
    total = (M + S - 1) * tick + M * head
    assert t.seconds == pytest.approx(total)
    busy = S * M * tick + M * head  # every stage's slots for every micro-batch, one head each
    assert t.bubble == pytest.approx(1 - busy / (S * total))
    assert sum(s.seconds for s in t.slots if s.kind == IDLE) == pytest.approx(S * total - busy)


@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (4, 2), (3, 1)])
def test_alternating_1f1b_slots(S, M):
    """Megatron's 1F1B as the lowering runs it: stage s holds S - s micro-batches; each
    half-slot lasts the slower pass (2 s of backward against 1 s of forward), and the
    head (0.5 s per micro-batch) follows the last stage's forward passes."""
    t = timeline(_record(S, M, fused=True, schedule="1f1b-async"))
    _check_dependencies(t)
    assert [t.in_flight(s) for s in range(S)] == [min(M, S - s) for s in range(S)]
    for st in range(S):  # after S - s forward passes a stage alternates, then drains
        kinds = "".join(s.kind[0] for s in t.slots if s.stage == st and s.kind != IDLE)
        kinds = kinds.replace("h", "")
        warm = min(M, S - st)
        assert kinds == "f" * warm + "bf" * (M - warm) + "b" * warm, (st, kinds)
    # 2 (M + S - 1) half-slots: those with a backward pass last 2 s, the others 1 s
    halves = [
        max(
            (2.0 if (h - st) % 2 else 1.0)
            for st in range(S)
            if 0 <= ((h - st) // 2 if (h - st) % 2 == 0 else (h - 2 * S + 1 + st) // 2) < M
        )
        for h in range(2 * (M + S - 1))
    ]
    assert t.seconds == pytest.approx(sum(halves) + 0.5 * M)
    busy = S * M * 3.0 + M * 0.5
    assert t.bubble == pytest.approx(1 - busy / (S * t.seconds))
    assert "alternating 1F1B" in schedule_line(t)


@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (4, 2), (3, 1)])
def test_zero_bubble_slots(S, M):
    """ZB-H1 as the lowering runs it (`autopar.lower.slots.zero_bubble`): a backward
    slot is the input gradient (2 s less the 0.75 s weight part), every micro-batch's
    weight gradients follow once on every stage, never before its backward pass and
    never in the first S - 1 backward slots; the loop's price (the record's 2 s
    slots) is S - 1 weight parts below lock-step 1F1B's, and stage s holds a
    micro-batch's activations until its weight gradients."""
    rec = _record(S, M, fused=True, schedule="zb-h1")
    w = 0.75
    rec["scans"][1]["seconds"] -= (S - 1) * w  # as `search.piped.loop_times` prices it
    rec["fused"][0]["weight_seconds"] = w
    t = timeline(rec)
    _check_dependencies(t)
    lock = timeline(_record(S, M, fused=True))
    assert t.seconds == pytest.approx(lock.seconds - (S - 1) * w)
    backward = [s for s in t.slots if s.kind == BACKWARD]
    assert all(s.seconds == pytest.approx(2.0 - w) for s in backward)
    first_b = min(s.start for s in t.slots if s.stage == 0 and s.kind == BACKWARD)
    for st in range(S):
        weights = [s for s in t.slots if s.stage == st and s.kind == WEIGHT]
        assert sorted(s.micro for s in weights) == list(range(M))
        for s in weights:
            b = next(x for x in backward if x.stage == st and x.micro == s.micro)
            assert s.start >= b.start + b.seconds and s.start >= first_b
    assert [t.in_flight(s) for s in range(S)] == [min(M, 2 * S - 1 - s) for s in range(S)]
    assert "ZB-H1" in schedule_line(t) and "W0" in t.rows()[0]


@pytest.mark.parametrize("S,M", [(2, 4), (4, 8)])
def test_gpipe_slots(S, M):
    t = timeline(_record(S, M, fused=False))
    _check_dependencies(t)
    assert [t.in_flight(s) for s in range(S)] == [M] * S  # all saved until the backward loop
    assert t.bubble == pytest.approx((S - 1) / (M + S - 1))
    first = [s.micro for s in t.slots if s.stage == S - 1 and s.kind == FORWARD]
    assert first == list(range(M))


def test_unpriced_record_is_marked_estimated():
    t = timeline(_record(2, 4, fused=True, seconds=False))
    assert t.estimated and "unit slot times" in schedule_line(t)
    _check_dependencies(t)
    rows = t.rows()
    assert rows[0].startswith("stage 0: F0 F1") and rows[1].startswith("stage 1: . F0 B0")


@pytest.mark.parametrize("S,M,v", [(2, 4, 2), (4, 8, 2), (2, 2, 3), (4, 4, 4)])
def test_interleaved_slots(S, M, v):
    """Interleaved 1F1B as the lowering runs it (`autopar.lower.slots.interleaved`): every
    stage runs each micro-batch through each of its `v` chunks once forward and once
    backward; a chunk's forward pass follows the previous virtual stage's (the stage
    before, or the last stage's previous chunk), a backward pass the next virtual
    stage's, the last chunk's backward on the last stage the head. The ramps shrink
    v-fold: the pipelined time is `(M + (S - 1) / v)` ticks of a stage's forward and
    backward, plus the heads."""
    rec = _record(S, M, fused=True, schedule="interleaved")
    rec["virtual_stages"] = v
    ticks = M * v + S - 1
    rec["scans"][0]["seconds"], rec["scans"][1]["seconds"] = ticks / v, 2.0 * ticks / v
    t = timeline(rec)
    end = {}
    for s in t.slots:
        if s.micro is not None and s.kind != HEAD:
            key = (s.kind, s.stage, s.micro, s.chunk)
            assert key not in end, key
            end[key] = (s.start, s.start + s.seconds)
    heads = {s.micro: s for s in t.slots if s.kind == HEAD}
    assert sorted(heads) == list(range(M)) and all(h.stage == S - 1 for h in heads.values())
    for m in range(M):
        for c in range(v):
            for st in range(S):
                f, b = end[(FORWARD, st, m, c)], end[(BACKWARD, st, m, c)]
                assert f[1] <= b[0]
                prev = (st - 1, c) if st else (S - 1, c - 1)
                if prev[1] >= 0:
                    assert end[(FORWARD, prev[0], m, prev[1])][1] <= f[0]
                after = (st + 1, c) if st < S - 1 else (0, c + 1)
                if after[1] < v:
                    assert end[(BACKWARD, after[0], m, after[1])][1] <= b[0]
                else:
                    h = heads[m]
                    assert f[1] <= h.start and h.start + h.seconds <= b[0]
    assert t.seconds == pytest.approx((M + (S - 1) / v) * 3.0 + 0.5 * M)
    lock = timeline(_record(S, M, fused=True))
    assert t.bubble < lock.bubble
    assert "interleaved 1F1B" in schedule_line(t) and f"x {v} virtual stages" in schedule_line(t)
    assert "F0.0" in t.rows()[0]


@pytest.mark.parametrize("S,v", [(2, 2), (4, 2), (3, 2), (2, 3), (4, 4), (8, 2)])
def test_chunk_moves_take_layer_order_to_chunk_order(S, v):
    """`chunk_moves`: each entry is one collective-permute (no stage sends or receives
    twice in it), and together they put block `c S + r` (virtual stage) in stage `r`'s
    slot `c`, from stage `u // v`'s block `u % v` where the loop's inputs hold it."""
    from autopar.passes.interleave import chunk_moves

    moves = chunk_moves(S, v)
    assert len(moves) <= v * v
    got = {}
    for (src, dst), pairs in moves.items():
        assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})
        for a, b in pairs:
            assert (b, dst) not in got
            got[(b, dst)] = a * v + src
    assert got == {(r, c): c * S + r for r in range(S) for c in range(v)}
    from autopar.passes.interleave import chunk_permutes

    assert chunk_permutes(S, v) == sum(any(a != b for a, b in p) for p in moves.values())


@pytest.mark.parametrize("S,M,v", [(2, 4, 2), (4, 16, 2), (8, 96, 2), (3, 6, 3), (4, 4, 4)])
def test_interleaved_slots_never_overwrite_a_live_activation(S, M, v):
    """`interleaved_slots`: per stage, two forward passes share a slot only when the
    first is read back (its backward slot) before the second is written, and the slot
    count is the most passes the schedule's timeline holds at once on any stage
    (`(v + 1) S - 1`, or all `M v`; a ring by pass number would need `2 v S - 1`)."""
    from autopar.passes.interleave import interleaved_slots

    R, table = interleaved_slots(S, M, v)
    for d in range(S):
        spans: dict[int, list[tuple[int, int]]] = {}
        for j in range(M * v):
            g, c, r = j // (S * v), (j % (S * v)) // S, j % S
            jb = g * S * v + (v - 1 - c) * S + r
            spans.setdefault(table[d][j], []).append((j + d, jb + v * S - 1 + S - 1 - d))
        for held in spans.values():
            held.sort()
            assert all(a[1] < b[0] for a, b in zip(held, held[1:])), (d, held)
        assert max(table[d]) < R
    rec = _record(S, M, fused=True, schedule="interleaved")
    rec["virtual_stages"] = v
    t = timeline(rec)
    assert max(t.in_flight(s) for s in range(S)) == R
    assert R == min(M * v, (v + 1) * S - 1) <= min(M * v, 2 * v * S - 1)
