"""Layer-stack candidates from parameter paths: runs of consecutive indices of one
template (`params/h_<i>`, siblings numbered alike `params/{ln_,mlp_}<i>`) with the
same leaves, read by forward ops, with the optimizer state that mirrors them. Step 1
of `autopar.passes.stacks` (whose module doc has the whole story), which then checks
each candidate's ops."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.ir.graph import FORWARD, Graph

_INDEXED = re.compile(r"(.*?)(\d+)")


@dataclass(frozen=True)
class Layer:
    index: int
    leaves: tuple[tuple[str, int], ...]  # (path below the indexed component, input position)
    state: tuple[int, ...]


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
        for r in runs_of(idx, same):
            if len(r) >= min_layers:
                run = {i: sorted(by_index[i]) for i in r}
                values = (graph.inputs[p] for lf in run.values() for _, p in lf)
                read = any(phase[c] == FORWARD for v in values for c in graph.consumers.get(v, ()))
                runs.append((tpl, run, read))
    out = []
    for tpl, run, read in runs:
        state: dict[int, list[int]] = defaultdict(list)
        for other, orun, oread in runs:
            if (
                read
                and not oread
                and _mirrors(other, tpl)
                and orun.keys() == run.keys()
                and all(_within(sig(orun[i], False), sig(run[i], False)) for i in run)
            ):
                for i in run:
                    state[i] += [p for _, p in orun[i]]
        if read:
            out.append((tpl, [Layer(i, tuple(run[i]), tuple(sorted(state[i]))) for i in run]))
    # outer templates first, then long runs, then more leaves a layer (siblings joined)
    return sorted(
        out, key=lambda c: (c[0].count("/"), -len(c[1]), -len(c[1][0].leaves), c[0], c[1][0].index)
    )


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
