"""Resharding prices of whole strategy tables at once.

A reshard's collectives (`autopar.cost.model.reshard_steps`) depend only on the two
specs; what they cost depends on the value only through its bytes. A `ReshardTable`
holds, for every (src, dst) pair of two strategy tables, which of a few distinct
collectives (kind, group size, link, divisor of the value's bytes) each step is, as
small integer codes; pricing the whole matrix for a value is then a handful of numpy
operations on the distinct collectives and one gather per step. The arithmetic is the
same, in the same order, as `CostModel.reshard` and `CostModel.bucketed`, so the
matrices are bit-identical to pricing every pair on its own
(`tests/test_planning_time.py::test_reshard_tables_equal_pairwise_prices`), at a fraction
of the time: the search prices hundreds of thousands of pairs on a 3-axis mesh.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import numpy as np

from autopar.cost.model import (
    BUS_FACTOR,
    COMBINABLE,
    COMBINE_THRESHOLD_BYTES,
    CostModel,
    reshard_steps,
)
from autopar.sharding import Spec

__all__ = ["ReshardTable", "reshard_table"]

GATHERS = frozenset({"all-gather", "all-to-all"})


class _Steps:
    """The step sequence (`reshard_steps`) of every spec pair met so far, numbered, for
    every mesh: it depends on the two specs alone, not on the mesh's sizes, so the
    shapes of a mesh-shape search that share their axis names share it (what a step
    costs is each mesh's, `_Palette`). Specs are numbered too (a few hundred on a
    3-axis mesh), and the pairs' sequence numbers kept in a dense [src, dst] table,
    read with one gather per strategy-table pair: a 3-axis build looks up ~0.7 M
    pairs, which a dict read one by one in ~0.3 s.

    A new pair's steps are those of the pair without the dims both leave whole (no
    axis to keep, move or gather there; the layouts the steps move keep their
    devices, hence their bytes): on a rank-5 GQA einsum's operands most of a 3-axis
    mesh's pairs are one rank-2 or rank-3 pair. On a 4-layer Llama planned on
    `mesh=8`, 189k new pairs came to 19k `reshard_steps` calls."""

    def __init__(self):
        self.specs: dict[Spec, int] = {}  # spec -> id
        self.by_id: list[Spec] = []
        self.table = np.full((0, 0), -1, dtype=np.int32)  # [src id, dst id] -> sequence
        self.seqs: dict[tuple, int] = {}  # a `reshard_steps` sequence -> its number
        self.by_seq: list[tuple] = []
        self.sharded: list[int] = []  # spec id -> bit mask of the dims it splits
        self.reduced: dict[tuple[int, int], int] = {}  # (spec id, dims kept) -> reduced id
        self.rids: dict[Spec, int] = {}  # a reduced spec -> its id
        self.rspecs: list[Spec] = []
        self.canon: dict[tuple[int, int], int] = {}  # a reduced id pair -> its sequence

    def ids(self, specs: Sequence[Spec]) -> np.ndarray:
        get, by_id = self.specs.get, self.by_id
        out = []
        for s in specs:
            i = get(s)
            if i is None:
                i = self.specs[s] = len(by_id)
                by_id.append(s)
                self.sharded.append(sum(1 << k for k, d in enumerate(s.dims) if d))
            out.append(i)
        if len(by_id) > len(self.table):  # room for the new ids, half as many again
            n = max(len(self.table) * 3 // 2, len(by_id), 64)
            grown = np.full((n, n), -1, dtype=np.int32)
            grown[: len(self.table), : len(self.table)] = self.table
            self.table = grown
        return np.array(out, dtype=np.int64)

    def numbers(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The step sequence number of each pair (src[i], dst[i]) of spec ids, made
        where new (in the pairs' order)."""
        seq = self.table[src, dst].astype(np.int64)
        new = np.flatnonzero(seq < 0)
        if len(new):
            a, b = src[new], dst[new]
            dims = np.array(self.sharded, dtype=np.int64)
            dims = dims[a] | dims[b]
            ra, rb = self._reduced(a, dims), self._reduced(b, dims)
            r = len(self.rspecs)
            keys, back = np.unique(ra * r + rb, return_inverse=True)
            made = np.array([self._sequence(k // r, k % r) for k in keys.tolist()])[back]
            seq[new] = made
            self.table[a, b] = made
        return seq

    def _reduced(self, ids: np.ndarray, dims: np.ndarray) -> np.ndarray:
        """The reduced spec id of each spec id `ids[i]` kept to the dims of bit mask
        `dims[i]`, each distinct (id, mask) made once."""
        width = int(dims.max()) + 1
        keys, back = np.unique(ids * width + dims, return_inverse=True)
        return np.array([self._reduce(k // width, k % width) for k in keys.tolist()])[back]

    def _reduce(self, i: int, dims: int) -> int:
        """The reduced id of spec `i` with only the dims in bit mask `dims` (its
        pending sums kept)."""
        got = self.reduced.get((i, dims))
        if got is None:
            spec = self.by_id[i]
            kept = Spec(tuple(d for k, d in enumerate(spec.dims) if dims >> k & 1), spec.partial)
            got = self.reduced[i, dims] = self.rids.setdefault(kept, len(self.rspecs))
            if got == len(self.rspecs):
                self.rspecs.append(kept)
        return got

    def _sequence(self, ra: int, rb: int) -> int:
        """The number of the steps from reduced spec `ra` to `rb`, made where new."""
        n = self.canon.get((ra, rb))
        if n is None:
            steps = reshard_steps(self.rspecs[ra], self.rspecs[rb])
            n = self.canon[ra, rb] = self.seqs.setdefault(steps, len(self.by_seq))
            if n == len(self.by_seq):
                self.by_seq.append(steps)
        return n


_STEPS = _Steps()


class _Palette:
    """The distinct collectives of one mesh's reshards, coded 1, 2, ... (0: no step);
    each (src, dst) pair's steps as one of the distinct step sequences (few: a mesh's
    reshards are combinations of a handful of collectives)."""

    def __init__(self, cost: CostModel, steps: _Steps):
        self.cost, self.all = cost, steps
        self.index: dict[tuple, int] = {}  # (kind, axes, divisor) -> code
        self.steps: dict[tuple, int] = {}  # a `reshard_steps` step -> its code
        self.rows: list[tuple] = [("", 0.0, 1.0, 1.0, 1, 0.0)]
        # a `_Steps` sequence number -> this mesh's sequence (-1: not coded yet)
        self.coded = np.full(0, -1, dtype=np.int64)
        self.seqs: dict[tuple[int, ...], int] = {(): 0}
        self.arrays: tuple | None = None
        self.seq_codes: np.ndarray | None = None

    def ids(self, specs: Sequence[Spec]) -> np.ndarray:
        return self.all.ids(specs)

    def sequences(self, src: Sequence[Spec], dst: Sequence[Spec], cross: bool) -> np.ndarray:
        """Per pair (every src x dst, row-major, or src[i] with dst[i]), its sequence.
        Each distinct pair is looked up once: a strategy table repeats its specs (its
        strategies read and make the same operand spec many times; on the 7B step's
        `mesh=256` screen, inline, the calls that make a new pair's sequence fell from
        285k to 199k, the builds' time by little)."""
        ia, ib = self.ids(src), self.ids(dst)
        if cross:
            ua, ra = np.unique(ia, return_inverse=True)
            ub, rb = np.unique(ib, return_inverse=True)
            src, dst = np.repeat(ua, len(ub)), np.tile(ub, len(ua))
            seq = self._lookup(src, dst)
            return seq.reshape(len(ua), len(ub))[ra[:, None], rb[None, :]].ravel()
        keys, back = np.unique((ia << 32) | ib, return_inverse=True)
        return self._lookup(keys >> 32, keys & 0xFFFFFFFF)[back]

    def _lookup(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The sequence of each pair of spec ids (src[i], dst[i]): its steps' number
        among all meshes' (`_Steps`), coded for this mesh where new."""
        steps = self.all.numbers(src, dst)
        if len(steps) and steps.max() >= len(self.coded):
            grown = np.full(max(2 * len(self.coded), steps.max() + 1), -1, dtype=np.int64)
            grown[: len(self.coded)] = self.coded
            self.coded = grown
        seq = self.coded[steps]
        new = np.unique(steps[seq < 0])
        if len(new):
            for n in new.tolist():
                codes = tuple(self._code(step) for step in self.all.by_seq[n])
                self.coded[n] = self.seqs.setdefault(codes, len(self.seqs))
            self.seq_codes = None
            seq = self.coded[steps]
        return seq

    def _code(self, step: tuple[str, tuple[str, ...], Spec]) -> int:
        code = self.steps.get(step)  # a step recurs in many pairs' sequences
        if code is None:
            code = self.steps[step] = self._new_code(*step)
        return code

    def _new_code(self, kind: str, axes: tuple[str, ...], layout: Spec) -> int:
        mesh = self.cost.mesh
        n = math.prod(mesh.size(a) for a in axes)
        if n <= 1:
            return 0  # a group of one device: nothing moves, 0 s
        key = (kind, axes, layout.shards(mesh))
        code = self.index.get(key)
        if code is None:
            latency, bw = self.cost.link(axes)
            code = self.index[key] = len(self.rows)
            copies = self.cost.local_copy_seconds(kind)
            self.rows.append((kind, latency, BUS_FACTOR[kind](n), bw, key[2], copies))
            self.arrays = None
        return code

    def codes(self, seq: np.ndarray) -> np.ndarray:
        """[steps, pairs]: each pair's collective codes, padded with 0 (no step)."""
        if self.seq_codes is None:
            width = max(map(len, self.seqs), default=0)
            table = np.zeros((len(self.seqs), width), dtype=np.int32)
            for codes, i in self.seqs.items():
                table[i, : len(codes)] = codes
            self.seq_codes = table
        return self.seq_codes[seq].T

    def columns(self) -> tuple[np.ndarray, ...]:
        """latency, bus factor, bandwidth, bytes divisor, all-reduce?, gathers?, HBM copy
        seconds per byte (`CostModel.local_copy_seconds`) per code."""
        if self.arrays is None:
            rows = self.rows
            self.arrays = (
                np.array([r[1] for r in rows]),
                np.array([r[2] for r in rows]),
                np.array([r[3] for r in rows]),
                np.array([r[4] for r in rows], dtype=np.int64),
                np.array([r[0] in COMBINABLE for r in rows]),
                np.array([r[0] in GATHERS for r in rows]),
                np.array([r[5] for r in rows]),
            )
        return self.arrays


# Palettes kept across builds, by (profile, mesh): the tries of one call (micro-batch
# counts, remat policies) build problems on the same few meshes, and a palette's pair
# codes depend on nothing else. At most MAX_PALETTES of them; past MAX_SPECS specs (its
# [src, dst] table then holds 16-36 MiB; the 7B step's three 3-axis shapes use 456) the
# step sequences of all meshes (`_STEPS`) start afresh, and so do the palettes.
MAX_PALETTES = 8
MAX_SPECS = 2048
_PALETTES: collections.OrderedDict[tuple, _Palette] = collections.OrderedDict()


def _palette(cost: CostModel, memo: dict) -> _Palette:
    global _STEPS
    pal = memo.get("palette")
    if pal is None or memo.get("palette_for") is not cost:
        key = (cost.profile, cost.mesh)
        if len(_STEPS.by_id) > MAX_SPECS:  # its spec ids go: so do the palettes' pairs
            _STEPS = _Steps()
            _PALETTES.clear()
        pal = _PALETTES.get(key)
        if pal is None:
            pal = _PALETTES[key] = _Palette(cost, _STEPS)
        _PALETTES.move_to_end(key)
        while len(_PALETTES) > MAX_PALETTES:
            _PALETTES.popitem(last=False)
        memo["palette"], memo["palette_for"] = pal, cost
    return pal


class ReshardTable:
    """The collectives of resharding every `src` spec into every `dst` spec (row-major;
    with `cross=False`, `src[i]` into `dst[i]`) on one mesh, for a value of any size:
    `codes[c, p]` names pair `p`'s step `c` among the mesh's distinct collectives."""

    def __init__(
        self, cost: CostModel, src: Sequence[Spec], dst: Sequence[Spec], cross: bool, memo: dict
    ):
        self.palette = pal = _palette(cost, memo)
        self.codes = pal.codes(pal.sequences(src, dst, cross))

    def _step_seconds(self, nbytes: int, share: float | None) -> np.ndarray:
        """Seconds of each distinct collective for a value of `nbytes` (index 0: none);
        with a `share`, all-reduces priced by bucket (`CostModel.bucketed`)."""
        latency, factor, bandwidth, divisor, combinable, _, copies = self.palette.columns()
        nb = nbytes // divisor
        sec = latency + factor * nb / bandwidth + copies * nb
        sec[0] = 0.0
        if share is not None:
            part = np.minimum(1.0, np.maximum(nb / COMBINE_THRESHOLD_BYTES, share))
            cut = combinable & (sec > 0)
            sec = np.where(cut, sec - latency * (1.0 - part), sec)
        return sec

    def seconds(self, nbytes: int, share: float | None = None) -> np.ndarray:
        """Per pair, the seconds of its reshard for a value of `nbytes`: the sum of its
        steps' seconds in order, as `CostModel.reshard` adds them."""
        sec = self._step_seconds(nbytes, share)
        total = np.zeros(self.codes.shape[1])
        for row in self.codes:
            total = total + sec[row]
        return total

    def gathers(self, nbytes: int) -> np.ndarray:
        """Per pair, whether its reshard all-gathers or moves (all-to-all) something."""
        moves = self.palette.columns()[5] & (self._step_seconds(nbytes, None) != 0)
        return moves[self.codes].any(axis=0)  # [0, pairs] (no steps) -> all False


def reshard_table(
    cost: CostModel,
    src: tuple[Spec, ...],
    dst: tuple[Spec, ...],
    memo: dict,
    cross: bool = True,
) -> ReshardTable:
    """The `ReshardTable` of `src` x `dst` (or, not `cross`, of `zip(src, dst)`),
    memoized in the caller's `memo` (one build's: tables are shared by every value whose
    operand and consumer tables match, and freed with the build; the palette of pair
    codes they read is kept across builds on the same mesh, `_palette`)."""
    key = ("table", src, dst, cross)
    table = memo.get(key)
    if table is None:
        table = memo[key] = ReshardTable(cost, src, dst, cross, memo)
    return table
