"""How a program whose unrolled layers `autopar.passes.roll` rolled into loops stands
for the user's: per rolled input and output, the user's flat leaves it holds (`Roll`),
and the paths that name them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.ir.graph import Graph
from autopar.passes.stacks import LayerStack, indexed_names, units_named


@dataclass(frozen=True)
class Roll:
    """How a rolled graph's flat inputs and outputs stand for the user's: per rolled
    input (output) the user's flat positions it holds, one (a leaf as it is) or one per
    stage (a group, stage order); `stacked[i]` when a group of scalars is stacked rather
    than concatenated along dim 0."""

    stages: int
    template: str
    layers: int
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    stacked_in: tuple[bool, ...]
    stacked_out: tuple[bool, ...]
    user_outputs: int
    out_tree: Any = field(default=None, compare=False)
    # (stages, virtual stages) where the groups are stored in the interleaved schedule's
    # chunk order (`autopar.ir.chunks`): each stage's leaves of every chunk it runs
    resident: tuple[int, int] | None = None
    # layers a unit, where the template's layers alternate between kinds and `layers`
    # counts units of `period` consecutive layers (`LayerStack.period`)
    period: int = 1

    def to_json(self) -> dict:
        out = {"template": self.template, "layers": self.layers, "stages": self.stages}
        if self.resident is not None:
            out["stages"], out["virtual_stages"] = self.resident
        if self.period > 1:
            out["period"] = self.period
        return out

    def named(self) -> str:
        """`the 8 layers of T`, or `the 4 units of 2 layers of T`."""
        return units_named(self.layers, self.period, self.template)

    def donated(self, donate: Sequence[int]) -> tuple[int, ...]:
        """The rolled inputs all of whose leaves the user donates."""
        return tuple(i for i, ms in enumerate(self.inputs) if set(ms) <= set(donate))

    def describe(self) -> str:
        k = self.layers // self.stages
        groups = sum(len(m) > 1 for m in self.inputs)
        unit = f" units of {self.period} layers" if self.period > 1 else ""
        kind = f"unit{'s' * (k > 1)}" if self.period > 1 else f"layer{'s' * (k > 1)}"
        if self.resident is not None:
            S, v = self.resident
            return (
                f"layer stack: {self.layers}{unit} x {self.template} (unrolled in Python) rolled into "
                f"loops over {S} stages x {v} chunks of {k} {kind}; {groups} "
                f"leaves grouped per chunk and layer slot (layer (c*{S}+s)*{k}+j of every "
                "stage s), split over the stage axis: each stage keeps its chunks' layers"
            )
        return (
            f"layer stack: {self.layers}{unit} x {self.template} (unrolled in Python) rolled into "
            f"loops over {self.stages} stages of {k} {kind}; {groups} leaves "
            "grouped per layer slot (layer s*k+j of every stage s), split over the stage axis"
        )


def _group_path(path: str, template: str, indices: Sequence[int], period: int = 1) -> str:
    """`params/h_3/attn/w` -> `params/h_<3,7>/attn/w` (the group of layers 3 and 7).
    `indices` are the layers' (units of `period` layers') first indices: a leaf of a
    unit's second layer (`h_4/...` in the unit of layers 3, 4) names layers 4 and 8."""
    comps = path.split("/")
    named = {
        f"{base}{indices[0] + q}": (base, q)
        for base in indexed_names(template)
        for q in range(period)
    }
    at = max((i for i, c in enumerate(comps) if c in named), default=None)
    if at is None:
        return f"{path} <{','.join(map(str, indices))}>"
    base, q = named[comps[at]]
    comps[at] = f"{base}<{','.join(str(i + q) for i in indices)}>"
    return "/".join(comps)


def layout(count: int, groups, g: Graph, values, paths, stack: LayerStack):
    """Per rolled input (output): the user's positions it holds (one, or a group's in
    stage order), whether it stacks scalars, and its path; `groups` is each group's
    positions with its layers' indices, `values`/`paths` the user's ids and paths."""
    member = {p: gi for gi, (ms, _) in enumerate(groups) for p in ms}
    entries, stacked, names, done = [], [], [], set()
    for p in range(count):
        gi = member.get(p)
        if gi is None:
            entries.append((p,))
            stacked.append(False)
            names.append(paths[p])
        elif gi not in done:
            done.add(gi)
            ms, ids = groups[gi]
            entries.append(tuple(ms))
            stacked.append(g.values[values[p]].rank == 0)
            names.append(_group_path(paths[ms[0]], stack.template, ids, stack.period))
    return entries, stacked, names
