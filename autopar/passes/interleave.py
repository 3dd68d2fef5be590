"""The interleaved 1F1B schedule's arithmetic (`pipeline_schedule="interleaved"`): which
virtual stage a stage runs in each pass, which buffer slot holds each chunk pass, and
how a loop's per-layer rows move between layer order and chunk order, and which need
not (`resident`). Integer bookkeeping shared by the lowering (`autopar.lower`), the
cost model (`search.piped`) and the plan's timeline (`plan.schedule`)."""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence

from autopar.ir.graph import Graph


def chunk_moves(stages: int, virtual: int) -> dict[tuple[int, int], tuple[tuple[int, int], ...]]:
    """How a loop's per-layer rows, split over the stage axis in layer order (stage `d`
    holds blocks `d v .. d v + v - 1` of `S v` equal blocks), move to the interleaved
    order (stage `r`'s slot `c` holding block `c S + r`, the virtual stage `c S + r`):
    per (source slot, destination slot), the (source stage, destination stage) pairs
    of one collective-permute. At most `v^2` of them; each stage sends and receives
    `v` blocks in all. Swap each pair (and the key) for the way back."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for c in range(virtual):
        for r in range(stages):
            u = c * stages + r
            out.setdefault((u % virtual, c), []).append((u // virtual, r))
    return {k: tuple(v) for k, v in out.items()}


def interleaved_pass(j, stages: int, virtual: int, backward: bool = False):
    """A stage's forward (backward) pass `j` under the interleaved schedule, as
    (micro-batch, chunk): `j = g S v + c S + r` is micro-batch `g S + r` through chunk
    `c` (micro-batches in groups of `S`, each group through every chunk before the
    next; backward passes take the chunks in reverse). Plain ints or traced arrays."""
    g, c, r = j // (stages * virtual), (j % (stages * virtual)) // stages, j % stages
    return g * stages + r, (virtual - 1 - c if backward else c)


def interleaved_number(m, c, stages: int, virtual: int, backward: bool = False):
    """`interleaved_pass` inverted: the pass number of micro-batch `m` through chunk `c`."""
    c = virtual - 1 - c if backward else c
    return (m // stages) * stages * virtual + c * stages + m % stages


@functools.lru_cache(maxsize=64)
def interleaved_slots(stages: int, microbatches: int, virtual: int) -> tuple[int, tuple]:
    """Where the interleaved schedule keeps each forward pass's saved activations:
    (slots per stage, per stage the slot of each forward pass `j`). The schedule is
    static (`autopar.lower.slots.interleaved`: stage `d` runs forward pass `j` in slot
    `j + d` and reads it back in backward slot `j_b + v S - 1 + S - 1 - d`, `j_b` the
    same chunk pass's backward number), so the slots are an interval colouring made
    once, greedily in order of writing (optimal for intervals): as many slots as
    passes a stage holds at once, `(v + 1) S - 1` on the first stage, against the `2 v
    S - 1` a ring by pass number would need. A slot written in slot `t` must have been
    read before `t` (a slot's forward pass runs before its backward one)."""
    S, M, v = stages, microbatches, virtual
    table, most = [], 0
    for d in range(S):
        spans = []
        for j in range(M * v):
            jb = interleaved_number(*interleaved_pass(j, S, v), S, v, backward=True)
            spans.append((j + d, jb + v * S - 1 + S - 1 - d, j))
        free: list[int] = []
        busy: list[tuple[int, int]] = []  # (read slot, slot)
        slot_of = [0] * (M * v)
        used = 0
        for write, read, j in sorted(spans):
            while busy and busy[0][0] < write:
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                k = heapq.heappop(free)
            else:
                k, used = used, used + 1
            slot_of[j] = k
            heapq.heappush(busy, (read, k))
        table.append(tuple(slot_of))
        most = max(most, used)
    return most, tuple(table)


def chunk_permutes(stages: int, virtual: int) -> int:
    """The collective-permutes of `chunk_moves`: the entries in which some stage's block
    goes to another stage (in the others each stage keeps its own)."""
    moves = chunk_moves(stages, virtual).values()
    return sum(any(a != b for a, b in pairs) for pairs in moves)


def resident(graph: Graph, fused: Sequence) -> frozenset[int]:
    """The values of `graph` that the 1F1B regions `fused` (`passes.pipeline.Fused`)
    read and make in chunk order as they are (`autopar.ir.chunks`): the per-layer
    inputs `chunk_rows` makes that only the regions' loops read, and the loops'
    per-layer results that only `unchunk_rows` reads outside their region. Neither is
    moved between the stages: a rolled stack's groups are stored in chunk order."""
    out = set()
    for f in fused:
        members, loops = f.members(), (f.forward, f.backward)
        for i in loops:
            for v in graph.nodes[i].outputs:
                outside = [c for c in graph.consumers.get(v, ()) if c not in members]
                unchunked = all(graph.nodes[c].op == "unchunk_rows" for c in outside)
                if outside and unchunked and v not in graph.outputs:
                    out.add(v)
        for v in {v for i in loops for v in graph.nodes[i].inputs}:
            p = graph.producer.get(v)
            readers = graph.consumers.get(v, ())
            made = p is not None and graph.nodes[p].op == "chunk_rows"
            if made and v not in graph.outputs and all(c in loops for c in readers):
                out.add(v)
    return frozenset(out)
