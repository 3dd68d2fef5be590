"""Repeated layers searched once, by every engine: a problem folded to one layer.

`search.layers` finds a model's repeated layers (``h_0 .. h_95``, ``layers/<i>``: the
first and last kept apart, the others merged into a representative ``R``) and its
`quotient` is the cost graph restricted to plans where every merged layer copies
``R``: its size does not grow with depth. `dp` has searched that quotient since the
first round; the other engines (D-Rec, the recipes, the propagation) read the graph
itself (op kinds, dataflow, argument paths), not only the cost tables, so a cost graph
is not enough for them. `fold` makes the whole `Problem` of the quotient: a `Graph`
holding the kept nodes only (the first layer, ``R``, the last, and everything outside
the layers), each node's costs and memory summed over the nodes merged into it, the
quotient's edges (a reshard between two merged layers is an edge inside ``R``, priced
once per merged layer). An engine searches it as it searches any problem, and its plan
is lifted back (`Fold.lift`: every merged node takes its representative's strategy),
to be polished and priced on the problem as it runs. A search on a deep stack unrolled
in Python then costs what it costs on three of its layers, as on a `scan` body.

The folded graph's dataflow: a kept node that read a merged node's value reads its
representative's value instead, so the last layer reads ``R``'s output. The chain of a
pass that runs the layers the other way (the backward pass: ``R``'s backward reads the
gradient the next, merged, layer's backward makes, that is ``R``'s own) would then read
a value made after it; such an input is taken from whichever merged copy of the node
reads a value made before it (the last merged layer's backward reads the last, kept,
layer's gradient). The costs do not depend on that choice: they are the quotient's.

A plan found so is layer-uniform: the engines' optimality claims hold among such plans
only (`info["folded"]` says what was folded). `ilp`, the yardstick, always searches the
problem whole.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autopar.ir.graph import Graph
from autopar.search.build import Problem
from autopar.search.layers import KEEP, find_layers, quotient, summed

__all__ = ["Fold", "fold", "folded_engine"]

# False: the engines search every problem whole (benchmarks compare the two this way).
ENABLED = True


@dataclass(frozen=True, eq=False)
class Fold:
    """A problem folded to its repeated layers' representatives (module docstring):
    `problem` is the folded one, `idx[v]` the folded node of the full problem's node
    `v`."""

    problem: Problem
    idx: np.ndarray
    nodes: int  # the full problem's nodes
    groups: dict[str, dict[str, object]]

    def pins(self, pinned: Mapping[int, int]) -> dict[int, int]:
        """The full problem's pins on the folded nodes (`find_layers` merges only layers
        pinned alike)."""
        return {int(self.idx[v]): s for v, s in pinned.items()}

    def lift(self, choice: Sequence[int]) -> list[int]:
        """A plan of the folded problem as a plan of the full one."""
        return [int(choice[k]) for k in self.idx]

    @functools.cached_property
    def members(self) -> list[list[int]]:
        """Per folded node, the full problem's nodes folded into it, in order."""
        out: list[list[int]] = [[] for _ in self.problem.strategies]
        for v, k in enumerate(self.idx):
            out[k].append(v)
        return out

    def describe(self) -> str:
        layers = ", ".join(
            f"{g['merged'] + len(g['kept'])} x {fam} ({g['merged']} merged)"
            for fam, g in self.groups.items()
        )
        return f"{self.nodes} nodes searched as {self.problem.num_inputs + len(self.problem.graph.nodes)}: {layers}"


# problem -> {pins: Fold | None}; a search folds each problem once per set of pins
_FOLDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fold(problem: Problem, pinned: Mapping[int, int] = {}) -> Fold | None:  # noqa: B006
    """`problem` folded to its repeated layers (module docstring); None where nothing
    folds (no repeated layers, or a pipeline's problem, whose schedule terms tie nodes
    that folding would lose)."""
    if not ENABLED or problem.regions or problem.resident or problem.waits or problem.buffers:
        return None
    key = tuple(sorted(pinned.items()))
    cache = _FOLDS.setdefault(problem, {})
    if key not in cache:
        cache[key] = _fold(problem, pinned)
    return cache[key]


def _fold(problem: Problem, pinned: Mapping[int, int]) -> Fold | None:
    layers = find_layers(problem, pinned, 0 if problem.loop_body else KEEP)
    if layers.merged == 0:
        return None
    phi = layers.phi
    q, idx = quotient(problem.cost_graph(), phi)
    g, n_in = problem.graph, problem.num_inputs
    n = len(phi)
    own = phi == np.arange(n)
    # value id -> its representative's (a merged argument's, a merged node's outputs);
    # representative graph node -> its merged copies
    vmap: dict[int, int] = {}
    copies: dict[int, list[int]] = {}
    for v in np.flatnonzero(~own):
        r = int(phi[v])
        if v < n_in:
            vmap[g.inputs[v]] = g.inputs[r]
            continue
        for a, b in zip(g.nodes[v - n_in].outputs, g.nodes[r - n_in].outputs):
            vmap[a] = b
        copies.setdefault(r - n_in, []).append(int(v) - n_in)
    kept_inputs = [i for i in range(n_in) if own[i]]
    kept_nodes = [node for node in g.nodes if own[n_in + node.id]]
    new_id = {node.id: j for j, node in enumerate(kept_nodes)}
    made_at: dict[int, int] = {}  # value id -> folded position of its maker
    for node in kept_nodes:
        for x in node.outputs:
            made_at[x] = new_id[node.id]

    def before(x: int, at: int) -> bool:
        return made_at.get(x, -1) < at

    nodes = []
    for node in kept_nodes:
        at = new_id[node.id]
        inputs = []
        for j, x in enumerate(node.inputs):
            y = vmap.get(x, x)
            if not before(y, at):  # a reversed chain: a merged copy's input made before
                got = (
                    vmap.get(c.inputs[j], c.inputs[j])
                    for c in map(g.nodes.__getitem__, copies.get(node.id, ()))
                )
                y = next((z for z in got if before(z, at)), y)
            inputs.append(y)
        nodes.append(replace(node, id=at, inputs=tuple(inputs)))
    graph = Graph(
        values=g.values,
        nodes=tuple(nodes),
        inputs=tuple(g.inputs[i] for i in kept_inputs),
        input_paths=tuple(g.input_paths[i] for i in kept_inputs),
        outputs=tuple(vmap.get(x, x) for x in g.outputs),
        output_paths=g.output_paths,
        consts=g.consts,
        in_tree=g.in_tree,
        out_tree=g.out_tree,
        name=g.name,
    )
    keep = np.flatnonzero(own)
    source = {x: (int(idx[u]), k) for x, (u, k) in problem.source.items() if own[u]}

    def by_node(d: Mapping[int, Any]) -> dict[int, Any]:
        return {new_id[k]: v for k, v in d.items() if k in new_id}

    flops = np.asarray(summed(problem.flops, phi, idx), dtype=np.float64)
    folded = replace(
        problem,
        graph=graph,
        strategies=tuple(problem.strategies[v] for v in keep),
        source=source,
        aliases={o: int(idx[i]) for o, i in problem.aliases.items()},
        flops=flops,
        node_time=q.node_cost,
        node_mem=q.node_mem,
        edges=q.edges,
        bodies=by_node(problem.bodies),
        conds=by_node(problem.conds),
        node_compute=None
        if problem.node_compute is None
        else tuple(summed(problem.node_compute, phi, idx)),
        loop_comm=by_node(problem.loop_comm),
        copies=np.bincount(idx, weights=problem.copies, minlength=len(keep)).astype(np.int64),
    )
    return Fold(folded, idx, n, layers.groups)


Engine = Callable[[Problem, Mapping[int, int], dict], list[int]]


def folded_engine(engine: Engine) -> Engine:
    """`engine` run on the problem folded to its repeated layers (`fold`), its plans
    (and the runner-ups in `info["alternates"]`) lifted back; as it is where nothing
    folds. `info["folded"]` says what was folded, and `optimal` is withdrawn: the plan
    is the best among layer-uniform ones at most."""

    def run(problem: Problem, pinned: Mapping[int, int], info: dict) -> list[int]:
        f = fold(problem, pinned)
        if f is None:
            return engine(problem, pinned, info)
        choice = engine(f.problem, f.pins(pinned), info)
        if "alternates" in info:
            info["alternates"] = [f.lift(a) for a in info["alternates"]]
        if info.get("optimal"):
            info.update(optimal=False, gap=None)
        info["folded"] = f.describe()
        return f.lift(choice)

    return run
