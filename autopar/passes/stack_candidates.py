"""Layer-stack candidates from parameter paths: runs of consecutive indices of one
template (`params/h_<i>`, siblings numbered alike `params/{ln_,mlp_}<i>`) with the
same leaves, read by forward ops, with the optimizer state that mirrors them. Where
layers of one template alternate between kinds (dense and MoE blocks, every other
layer), runs of *units* of `p` consecutive layers with the same leaves (`Layer.period`).
Step 1 of `autopar.passes.stacks` (whose module doc has the whole story), which then
checks each candidate's ops."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.ir.graph import FORWARD, Graph

_INDEXED = re.compile(r"(.*?)(\d+)")


@dataclass(frozen=True)
class Layer:
    """One layer of a candidate run, or a unit of `period` consecutive layers (`index`
    the first): its leaves keyed by the path below the indexed component (in a unit,
    prefixed by the member's offset: `1/MoE_0/w1`)."""

    index: int
    leaves: tuple[tuple[str, int], ...]  # (path below the indexed component, input position)
    state: tuple[int, ...]
    period: int = 1

    @property
    def members(self) -> range:
        return range(self.index, self.index + self.period)


# the longest units of alternating layers looked for (`_units`)
MAX_PERIOD = 4


def candidates(graph: Graph, phase: Sequence[int], min_layers: int):
    """[(template, layers)]: runs of consecutive indices of a template with the same
    leaves, read by forward ops, with their mirrors; outer templates, long runs first."""
    groups: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    names: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for pos, path in enumerate(graph.input_paths):
        comps = path.split("/")
        for k, c in enumerate(comps):
            if m := _INDEXED.fullmatch(c):
                tpl = "/".join([*comps[:k], m[1] + "<i>"])
                groups[tpl][int(m[2])].append(("/".join(comps[k + 1 :]), pos))
                names["/".join(comps[:k])][m[1]].add(int(m[2]))
    _siblings(groups, names, min_layers)

    def sig(leaves, dtype=True):
        types = ((s, graph.values[graph.inputs[p]]) for s, p in leaves)
        return sorted((s, t.shape, t.dtype if dtype else None) for s, t in types)

    runs = []
    for tpl, by_index in groups.items():
        idx = sorted(by_index)
        same = lambda a, b, d=by_index: b == a + 1 and sig(d[a]) == sig(d[b])  # noqa: E731
        singles = runs_of(idx, same)
        found = [(1, {i: sorted(by_index[i]) for i in r}) for r in singles if len(r) >= min_layers]
        if 2 * max(map(len, singles)) < len(idx):  # mostly unlike neighbours: alternating?
            found += _units(idx, by_index, sig, min_layers)
        for period, run in found:
            values = (graph.inputs[p] for lf in run.values() for _, p in lf)
            read = any(phase[c] == FORWARD for v in values for c in graph.consumers.get(v, ()))
            runs.append((tpl, period, run, read))
    out = []
    for tpl, period, run, read in runs:
        state: dict[int, list[int]] = defaultdict(list)
        for other, operiod, orun, oread in runs:
            if (
                read
                and not oread
                and operiod == period
                and _mirrors(other, tpl)
                and orun.keys() == run.keys()
                and all(_within(sig(orun[i], False), sig(run[i], False)) for i in run)
            ):
                for i in run:
                    state[i] += [p for _, p in orun[i]]
        if read:
            layers = [Layer(i, tuple(run[i]), tuple(sorted(state[i])), period) for i in run]
            out.append((tpl, layers))
    # outer templates first, then runs covering more layers, then more units (a period
    # of 2 before 4), then more leaves a layer (siblings joined)
    return sorted(
        out,
        key=lambda c: (
            c[0].count("/"),
            -len(c[1]) * c[1][0].period,
            -len(c[1]),
            -len(c[1][0].leaves),
            c[0],
            c[1][0].index,
        ),
    )


def _units(idx: list[int], by_index: dict, sig, min_layers: int) -> list[tuple[int, dict]]:
    """Runs of at least `min_layers` units of `p` consecutive layers (2 <= p <=
    `MAX_PERIOD`, the smallest that makes a run) whose leaves match unit for unit, where
    layers alternate between kinds (`for i in range(n): Block(moe=i % 2 == 1)`): per
    run, (p, {first index: leaves keyed `offset/path`}). A unit's layers are not all
    alike (that is a run of single layers); the offset that covers most layers wins."""
    have = set(idx)
    for p in range(2, MAX_PERIOD + 1):
        best: list[list[int]] = []
        for o in range(p):
            starts = [
                i
                for i in range(idx[0] + o, idx[-1] + 1, p)
                if all(i + q in have for q in range(p))
                and len({repr(sig(by_index[i + q])) for q in range(p)}) > 1
            ]
            unit = {i: [sig(by_index[i + q]) for q in range(p)] for i in starts}
            alike = lambda a, b, p=p, u=unit: b == a + p and u[a] == u[b]  # noqa: E731
            got = [r for r in runs_of(starts, alike) if len(r) >= min_layers]
            if sum(map(len, got)) > sum(map(len, best)):
                best = got
        if best:
            keyed = lambda i, p=p: sorted(  # noqa: E731
                (f"{q}/{s}", pos) for q in range(p) for s, pos in by_index[i + q]
            )
            return [(p, {i: keyed(i) for i in r}) for r in best]
    return []


def _siblings(groups: dict, names: dict, min_layers: int) -> None:
    """Layers written inline (`x = x + Mlp(name=f"mlp_{i}")(LayerNorm(name=f"ln_{i}")(x))`)
    number several siblings with one index: one template joins them (`params/{ln_,mlp_}<i>`,
    each leaf's path below it keeping its own name) where they share their indices."""
    for parent, by_name in names.items():
        alike: dict[frozenset, list[str]] = defaultdict(list)
        for name, indices in by_name.items():
            alike[frozenset(indices)].append(name)
        for indices, group in alike.items():
            if len(group) < 2 or len(indices) < min_layers:
                continue
            joined = "{" + ",".join(sorted(group)) + "}<i>"
            tpl = f"{parent}/{joined}" if parent else joined
            for name in sorted(group):
                own = groups[f"{parent}/{name}<i>" if parent else f"{name}<i>"]
                for i in indices:
                    groups[tpl][i] += [(f"{name}/{sub}", pos) for sub, pos in own[i]]


def indexed_names(template: str) -> tuple[str, ...]:
    """The names a template's layer index follows: `("h_",)` for `params/h_<i>`,
    `("ln_", "mlp_")` for siblings joined (`params/{ln_,mlp_}<i>`)."""
    last = template.rsplit("/", 1)[-1].removesuffix("<i>")
    return tuple(last[1:-1].split(",")) if last.startswith("{") else (last,)


def _within(state: list, leaves: list) -> bool:
    """Whether a state run's leaves are some of a layer's (path below the index and
    shape): an optimizer holds state for the trained leaves only, not for what else a
    layer keeps (NNX's `Dropout` keeps its RNG stream's key and count in the layer)."""
    return bool(state) and not Counter(state) - Counter(leaves)


def _mirrors(other: str, template: str) -> bool:
    """Whether template `other` (`state/1/0/mu/params/h_<i>`, `opt_state/0/mu/h_<i>`)
    ends in the indexed component of `template` (`state/0/params/h_<i>`): with the same
    leaves (the caller checks), the optimizer state mirroring a parameter run, whether
    both are arguments of their own or sit in one train-state tuple."""
    return other != template and other.split("/")[-1] == template.split("/")[-1]


def runs_of(items: list[int], same) -> list[list[int]]:
    """`items` split into maximal runs whose neighbours satisfy `same(a, b)`."""
    out: list[list[int]] = []
    for k, item in enumerate(items):
        if k and same(items[k - 1], item):
            out[-1].append(item)
        else:
            out.append([item])
    return out
