"""Repeated layers solved once: fold identical layers of a cost graph into one.

A deep model repeats one block: GPT's ``h_0 .. h_95``, each with its forward
ops, its backward ops, its parameters and optimizer state, and the optimizer
ops that update them. Their cost-graph nodes have the same strategy lists
position by position, so a plan can give every copy the same strategies.
This module restricts the ``dp`` search to such plans and solves the
restricted problem *exactly* on a graph whose size does not grow with depth.

**Detection** (:func:`find_layers`, needs the :class:`Problem` for names)

1. Every name (an op's name stack with the transformation wrappers such as
   ``jvp(...)`` / ``transpose(...)`` stripped, an argument's path) is split
   into segments; a segment ``base_<i>`` / ``base<i>`` (``h_3``,
   ``blocks_3``), or a bare number after a segment (``layers/3``), is
   *indexed*. A *family* is a base with at least ``2 * keep + 2`` distinct
   indices; a name belongs to the layer ``(base, i)`` of its first indexed
   segment whose base is a family (so ``opt_state/0`` is not a layer, and
   ``h_3/Dense_1`` belongs to ``h_3``).
2. Ops outside every layer's names (the optimizer update written outside any
   module; einsums, softmax and `jnp.where` scopes of a model written without
   modules, whose names are jnp's) join the layer of their neighbours when
   every labelled neighbour is in one layer (breadth-first, then any node whose
   labelled neighbours disagree is unlabelled again). Shared scalars (AdamW's
   step count and bias corrections) touch every layer and stay global. The
   embedding and head may join the first and last layer this way.
3. A layer's *signature* is its nodes in graph order with their strategy
   counts, op names and output types. Per family, the first and last ``keep``
   layers stay distinct (they touch the embedding and the head); among the
   others, the layers with the most common signature, ``m`` of them, are
   *merged* into the first of them, the representative ``R``, position by
   position (layers with another signature stay as they are). A layer whose
   strategy list at some position differs from ``R``'s, or whose pins (fixed
   strategies) differ, is not merged. The layer slots a rolled graph runs its
   optimizer in (``rolled_layers_slot<j>``, `passes.roll`: each over every stage's
   rows) are alike by construction: no end kept apart, two of them make a family.

**Reduction** (:func:`quotient`, pure cost graph). Map every node ``v`` to
``phi(v)``: a merged layer's node at position ``k`` to ``R``'s node ``k``,
every other node to itself. The quotient graph has one node per image;
node costs and memory are summed over preimages, an edge ``(u, v)`` adds
its matrix onto ``(phi(u), phi(v))``, and an edge whose ends map to the
same node (position ``k`` of one layer to position ``k`` of another) adds
its diagonal to that node's cost. So for every plan ``x`` of the quotient,
its lift ``x(v) = x(phi(v))`` costs exactly the same in the full graph
(time and additive memory): the quotient *is* the full problem restricted
to plans where the merged layers copy ``R``. Edges between consecutive
middle layers become edges inside ``R`` (``R``'s output -> ``R``'s input,
weighted ``m - 1``), so inter-layer resharding is still priced.

**Solve and lift** (:func:`solve_dp_layered`). ``dp`` solves the quotient,
which has ``2 * keep + 1`` layers whatever the depth, and the choice is
lifted back: one strategy index per node of the full graph, as from any
engine. The plan is optimal over layer-uniform plans when ``dp`` is exact on
the quotient; the full problem could do better by varying strategies between
middle layers, so the solution is not marked optimal. When ``dp`` has to guess
a kernel (GPT train steps: forward and backward of a layer share activations,
so the graph does not shrink by leaf/op steps alone), its forest-descent
polish gets more rounds here (``POLISH``) than on a full graph: the quotient
is small, so rounds are cheap. Measured: ``benchmarks/results/scale.md``.

**Starts.** A guessed kernel can settle in a poor local optimum; on GPT it
kept parameters replicated (no memory term pushes it off), although plans
that shard them are as fast or faster under the same cost model. So when
the first solve is not exact, ``dp`` solves the quotient again with the
state's bytes (the arguments the step returns updated: parameters and
optimizer state) priced at ``lam`` seconds per byte, where ``lam`` makes the
first plan's state cost ``STATE_WEIGHT`` of its time, and keeps whichever
plan is cheaper under the *true* costs (and within the budget); the price
only steers the search. Then the caller's ``starts`` (plans of the full
graph made by other engines: ``search.dp_starts``) are each polished by
forest descent on the quotient, and the cheapest plan under the objective is
kept; a staged start descends further only while it beats dp's own plan. The
runner-up goes back too (``info["runner_up"]``): the driver polishes both for
latency and keeps the cheaper under the final price (``search.search``).
"""

from __future__ import annotations

import re
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from autopar.ir.graph import is_body_path
from autopar.passes.roll import SCOPE as ROLL_SCOPE
from autopar.search.build import Problem
from autopar.search.solvers.costgraph import CostGraph, Solution
from autopar.search.solvers.dp import solve_dp
from autopar.search.solvers.forest import forest_descent

__all__ = ["Layers", "find_layers", "layer_labels", "quotient", "solve_dp_layered", "summed"]

# How many layers at each end of a group keep their own strategies.
KEEP = 1
# False: solve_dp_layered is plain solve_dp (benchmarks compare the two this way).
ENABLED = True
# Forest-descent (max_rounds, patience) on the quotient when dp's kernel was guessed:
# the quotient is small whatever the depth, so it gets a longer polish than dp's default.
POLISH = (200, 20)
# Cone rounds (`forest_descent` with random=False) on the full graph after the quotient's
# plan is lifted: (max rounds, patience).
CONES = (12, 2)
# The second solve prices state bytes so that the first plan's state would cost this
# fraction of its time (module docstring, "Starts").
STATE_WEIGHT = 0.1

_WRAPPER = re.compile(r"^(?:[A-Za-z_]\w*\()+|\)+$")
_INDEXED = re.compile(r"^(?P<base>[A-Za-z][\w.]*?)[_.]?(?P<idx>\d+)$")
_NUMBER = re.compile(r"^\d+$")
_SLOTS = f"{ROLL_SCOPE}_slot"  # the family of a rolled graph's layer slots


@dataclass(frozen=True)
class Layers:
    """Which cost-graph nodes are merged into which.

    phi[v]: the node v is merged into (v itself when it is not merged).
    groups: per family, the layers in its group, the indices kept distinct (the
      representative among them), the representative's index, how many layers were
      merged into it and the nodes per layer.
    """

    phi: np.ndarray
    groups: dict[str, dict[str, object]]

    @property
    def merged(self) -> int:
        """Nodes folded into a representative (0: nothing to gain)."""
        return int((self.phi != np.arange(len(self.phi))).sum())


def _indexed(name: str):
    """((base, index), the segment as written: `h_3`, `layers/3`) of every indexed
    segment of a name, outermost first."""
    prev = ""
    for seg in name.split("/"):
        seg = _WRAPPER.sub("", seg)
        if _NUMBER.match(seg):
            if prev:
                yield (prev, int(seg)), f"{prev}/{seg}"
        else:
            m = _INDEXED.match(seg)
            if m:
                yield (m["base"], int(m["idx"])), seg
        prev = seg


def _segments(name: str) -> list[tuple[str, int]]:
    """(base, index) of every indexed segment of a name, outermost first."""
    return [label for label, _ in _indexed(name)]


def _shown(name: str, label: tuple[str, int]) -> str | None:
    """The segment of `name` that makes it layer `label`, as `inspect` names a layer's
    arrays: `layers/3`, `h_3`."""
    return next((seg for lab, seg in _indexed(name) if lab == label), None)


def op_layer_names(problem: Problem) -> list[str]:
    """Per op, the layer the search placed it in (`layer_labels`: by its name, else by
    its labelled neighbours, so the loss may join the last layer), named as its arrays'
    paths name it (`layers/3`), for a step whose ops name no layer (NNX modules and
    plain functions add no name scopes to the ops they trace); all "" otherwise."""
    labels, names = _label(problem, 0, alike=True), _names(problem)
    shown: dict[tuple[str, int], str] = {}
    for k in range(problem.num_inputs):
        if labels[k] is not None and labels[k] not in shown:
            got = _shown(names[k], labels[k])
            if got is not None:
                shown[labels[k]] = got
    out = []
    for node in problem.graph.nodes:
        lab = labels[problem.num_inputs + node.id]
        name = shown.get(lab, "") if lab is not None else ""
        if name and f"/{name}/" in f"/{node.name_stack}/":  # ops that name their layers
            return [""] * len(problem.graph.nodes)  # (linen's): the keys say it all
        out.append(name)
    return out


def _names(problem: Problem) -> list[str]:
    """Each cost-graph node's name; a loop body's arguments are named by their role
    (`body/x12`: `ir.graph.is_body_path`), which is no layer index."""
    g = problem.graph
    paths = ["" if is_body_path(p) else p for p in g.input_paths]
    return paths + [n.name_stack for n in g.nodes]


def _ends_kept(family: str, keep: int) -> int:
    """How many layers at each end of `family` stay distinct: `keep`, but none of the
    layer slots `passes.roll` writes outside its loops (the optimizer, once per slot,
    over all stages' rows), alike by construction; so two slots make a family."""
    return 0 if family == _SLOTS else keep


_LABELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer_labels(problem: Problem) -> list[tuple[str, int] | None]:
    """Each cost-graph node's layer (family, index), or None, for every family of two or
    more layers (no ends kept apart); once per problem."""
    if problem not in _LABELS:
        _LABELS[problem] = _label(problem, 0)
    return _LABELS[problem]


# graph -> {keep: labels}: the labels read the graph's names and dataflow neighbours, so
# the problems a search makes of one graph (a recipe's, other pins) share them
_GRAPH_LABELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _label(problem: Problem, keep: int, alike: bool = False) -> list[tuple[str, int] | None]:
    """Each cost-graph node's layer (family, index), or None for global nodes; once per
    graph, `keep` and `alike` (`_labelled`)."""
    per = _GRAPH_LABELS.setdefault(problem.graph, {})
    if (keep, alike) not in per:
        per[keep, alike] = _labelled(problem, keep, alike)
    return list(per[keep, alike])


def _labelled(problem: Problem, keep: int, alike: bool = False) -> list[tuple[str, int] | None]:
    """Each node's (family, index): its name's outermost indexed segment of a family (a
    base with enough indices), else its labelled neighbours' where they agree. `alike`:
    a family whose arguments differ at every index is none (a plain function's
    `(params, opt_state)` tuple, `state/0` and `state/1`, is no pair of layers), as
    `op_layer_names` shows layers."""
    names = _names(problem)
    segs = [_segments(nm) for nm in names]
    indices: dict[str, set[int]] = {}
    for ss in segs:
        for base, i in ss:
            indices.setdefault(base, set()).add(i)
    families = {b for b, ix in indices.items() if len(ix) >= 2 * _ends_kept(b, keep) + 2}
    if alike:
        families -= _unlike(problem, names)
    label: list[tuple[str, int] | None] = [
        next(((b, i) for b, i in ss if b in families), None) for ss in segs
    ]
    if not families:
        return label
    # Ops outside every layer's names (optimizer updates, jnp scopes) follow their labelled
    # neighbours.
    nb = problem.neighbours()
    n_in = problem.num_inputs
    free = [v >= n_in and label[v] is None for v in range(len(names))]

    def agreed(v):
        seen = {label[u] for u in nb[v] if label[u] is not None}
        return next(iter(seen)) if len(seen) == 1 else None

    queue = deque(v for v in range(len(names)) if label[v] is not None)
    while queue:
        u = queue.popleft()
        for v in nb[u]:
            if free[v] and label[v] is None:
                lab = agreed(v)
                if lab is not None:
                    label[v] = lab
                    queue.append(v)
    for _ in range(4):  # a node labelled early may touch several layers in the end
        bad = [v for v in range(len(names)) if free[v] and label[v] is not None and not agreed(v)]
        if not bad:
            break
        for v in bad:
            label[v] = None
    return label


def _unlike(problem: Problem, names: list[str]) -> set[str]:
    """The bases of argument paths no two of whose indices hold the same leaves (the
    paths below the indexed segment, with their shapes)."""
    g, leaves = problem.graph, {}
    for k in range(problem.num_inputs):
        for (base, i), seg in _indexed(names[k]):
            below = names[k].split(seg + "/", 1)[-1]
            at = leaves.setdefault(base, {}).setdefault(i, set())
            at.add((below, g.values[g.inputs[k]].shape))
    return {
        b
        for b, per in leaves.items()
        if max(Counter(frozenset(s) for s in per.values()).values()) < 2
    }


def find_layers(
    problem: Problem,
    pinned: Mapping[int, int] = {},
    keep: int = KEEP,  # noqa: B006
) -> Layers:
    """Detect repeated layers and the merge map (module docstring, steps 1-3)."""
    n = len(problem.strategies)
    phi = np.arange(n)
    label = _label(problem, keep)
    members: dict[str, dict[int, list[int]]] = {}
    for v, lab in enumerate(label):
        if lab is not None:
            members.setdefault(lab[0], {}).setdefault(lab[1], []).append(v)
    g, n_in = problem.graph, problem.num_inputs

    def sig_of(v):
        if v < n_in:
            return ("input", g.values[g.inputs[v]], len(problem.strategies[v]))
        node = g.nodes[v - n_in]
        return (node.op, tuple(g.values[x] for x in node.outputs), len(problem.strategies[v]))

    groups: dict[str, dict[str, object]] = {}
    for fam, layers in members.items():
        order = sorted(layers)
        k = _ends_kept(fam, keep)
        ends = set(order[:k] + order[len(order) - k :])
        sigs = {i: tuple(sig_of(v) for v in layers[i]) for i in order if i not in ends}
        if not sigs:
            continue
        common, _ = Counter(sigs.values()).most_common(1)[0]
        middle = sorted(i for i, s in sigs.items() if s == common)
        if len(middle) < 2:
            continue
        rep = layers[middle[0]]
        rep_pins = [pinned.get(v) for v in rep]
        merged = []
        for i in middle[1:]:
            vs = layers[i]
            same = all(
                problem.strategies[a] is problem.strategies[b]
                or problem.strategies[a] == problem.strategies[b]
                for a, b in zip(vs, rep)
            )
            if same and [pinned.get(v) for v in vs] == rep_pins:
                phi[vs] = rep
                merged.append(i)
        if merged:
            groups[fam] = {
                "layers": len(order),
                "kept": [i for i in order if i not in merged],
                "representative": middle[0],
                "merged": len(merged),
                "nodes_per_layer": len(rep),
            }
    return Layers(phi, groups)


def quotient(g: CostGraph, phi: np.ndarray) -> tuple[CostGraph, np.ndarray]:
    """The cost graph over the images of ``phi`` (module docstring, "Reduction").

    Returns the quotient graph and, per original node, its quotient node."""
    n = g.num_nodes()
    keep = np.flatnonzero(phi == np.arange(n))
    new = np.full(n, -1)
    new[keep] = np.arange(len(keep))
    idx = new[phi]
    if (idx < 0).any():
        raise ValueError("phi must map every node onto a node that maps to itself")
    cost, mem = summed(g.node_cost, phi, idx), summed(g.node_mem, phi, idx)
    edges: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), m in g.edges.items():
        a, b = int(idx[u]), int(idx[v])
        if a == b:  # position k of one merged layer to position k of another
            cost[a] += np.diagonal(m)
            continue
        if a > b:
            a, b, m = b, a, m.T
        if (a, b) in edges:
            edges[a, b] = edges[a, b] + m
        else:
            edges[a, b] = m
    return CostGraph(tuple(cost), tuple(mem), edges), idx


def summed(table: Sequence, phi: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """Per node ``v`` with ``phi(v) == v``, in order, ``table[v]`` (float64) plus the
    entries of the nodes merged into it (``idx``: `quotient`'s map onto those nodes)."""
    out = [np.array(table[v], dtype=np.float64) for v in np.flatnonzero(phi == np.arange(len(phi)))]
    for v in np.flatnonzero(phi != np.arange(len(phi))):
        out[idx[v]] = out[idx[v]] + table[v]
    return out


def _priced(g: CostGraph, nodes: list[int], lam: float) -> CostGraph:
    """``g`` with ``lam`` seconds per byte added to the strategies of ``nodes``."""
    cost = list(g.node_cost)
    for v in nodes:
        cost[v] = cost[v] + lam * g.node_mem[v]
    return CostGraph(tuple(cost), g.node_mem, g.edges)


def solve_dp_layered(
    problem: Problem,
    g: CostGraph,
    pinned: Mapping[int, int] = {},  # noqa: B006
    memory_budget: float = float("inf"),
    keep: int = KEEP,
    starts: Sequence[Start] = (),
) -> Solution:
    """``solve_dp`` on ``g`` (the problem's cost graph, pins applied) with repeated
    layers folded into one; the plan is lifted back to every node of ``g``. When dp had
    to guess, each of ``starts`` (`Start`) is polished by forest descent too, on the
    quotient (its representatives' strategies), and the cheapest plan kept."""
    if not ENABLED:
        return _with_starts(g, solve_dp(g, memory_budget), starts)
    t0 = time.perf_counter()
    layers = find_layers(problem, pinned, keep)
    if layers.merged == 0 and problem.copies is None:
        # nothing to fold (a shallow model): the graph is as small as a quotient, so its
        # guessed kernel gets the quotient's polish (patience 3 left GPT-1.3B's
        # data-parallel plan a layer norm split on its hidden dim, a 64 MiB all-to-all a
        # later forest removes). The second solve below would change plans here too (T5
        # with Adafactor on data 2 x model 2: 0.70x -> 0.61x the best hand layout, as
        # compiled), not yet measured on the suite on its own
        return _with_starts(g, solve_dp(g, memory_budget, polish=POLISH), starts)
    # a quotient, or a problem `search.fold` folded already: solved as a quotient, with
    # its second solve and cone rounds (without them, folded, an 8-layer Llama-style
    # step planned 2.4% dearer than whole)
    if layers.merged:
        q, idx = quotient(g, layers.phi)
    else:
        q, idx = g, np.arange(g.num_nodes())
    detect_s = time.perf_counter() - t0
    sol = solve_dp(q, memory_budget, polish=POLISH)
    tried = {"free": sol.cost}
    state = sorted({int(idx[i]) for i in problem.aliases.values() if i not in pinned})
    state_bytes = sum(float(q.node_mem[k][sol.choice[k]]) for k in state)
    if not sol.optimal and state_bytes > 0:
        # Second solve: the state's bytes priced in (module docstring, "Starts").
        lam = STATE_WEIGHT * sol.cost / state_bytes
        other = solve_dp(_priced(q, state, lam), memory_budget, polish=POLISH)
        x = list(other.choice)
        tried["state_priced"] = q.total(x)
        if tried["state_priced"] < sol.cost and q.memory(x) <= memory_budget:
            sol = other
    if not sol.optimal and starts:
        rep = np.empty(q.num_nodes(), dtype=np.int64)
        own = layers.phi == np.arange(len(idx))  # representatives and unmerged nodes
        rep[idx[own]] = np.flatnonzero(own)
        sol = _with_starts(q, sol, [(_on_quotient(f, rep), *rest) for f, *rest in starts])
        tried["start"] = sol.info.get("start_cost")
    choice = tuple(int(sol.choice[k]) for k in idx)
    if sol.optimal and not layers.merged:
        return sol
    if not sol.optimal:
        # the quotient ties the merged layers' nodes together, so a chain through
        # them (a clipped optimizer's global norm summed over every layer's gradients)
        # has cycles there that no forest holds whole: cone rounds on the full graph
        # (on the problem's own tables, whose compiled graph D-Rec and `refine` share,
        # the pins held: no presolve of the full graph)
        t1 = time.perf_counter()
        lifted = CostGraph.lift_choice(choice, pinned)
        full, _ = forest_descent(
            problem.node_time, problem.edges, lifted, *CONES, random=False, pinned=pinned
        )
        full = CostGraph.lower_choice(full, pinned)
        if g.total(full) < g.total(choice):
            choice = tuple(full)
        tried["cones"] = g.total(choice)
        tried["cones_s"] = time.perf_counter() - t1
    info = dict(sol.info)
    if "runner_up" in info:
        info["runner_up"] = tuple(int(info["runner_up"][k]) for k in idx)
    info["layers"] = {
        "groups": layers.groups,
        "nodes": g.num_nodes(),
        "reduced_nodes": q.num_nodes(),
        "reduce_s": detect_s,
        "reduced_optimal": sol.optimal,
        "starts": tried,
    }
    return Solution(
        choice=choice,
        cost=g.total(choice),
        memory=g.memory(choice),
        optimal=False,  # optimal among layer-uniform plans at best
        gap=None,
        seconds=time.perf_counter() - t0,
        info=info,
    )


# A start for `solve_dp_layered`: a plan of the cost graph (made when needed), the forest
# descent's (max rounds, patience) for it, or stages of them (each later one run only
# while the start beats dp's own plan), and the objective the plan found so far must
# reach for the start to be worth trying (0: always).
Rounds = tuple[int, int]
Start = tuple[Callable[[], Sequence[int]], Rounds | tuple[Rounds, ...], float]


def _on_quotient(start: Callable[[], Sequence[int]], rep: np.ndarray) -> Callable[[], list[int]]:
    """`start` (a plan of the full graph) as a plan of the quotient: its representatives'
    strategies."""

    def plan() -> list[int]:
        full = start()
        return [int(full[v]) for v in rep]

    return plan


def _with_starts(g: CostGraph, sol: Solution, starts: Sequence[Start]) -> Solution:
    """``sol``, or the forest descent of one of ``starts`` on ``g`` where that is
    cheaper; dp guessed part of the graph and polished the guess locally, which can
    stall in a poor optimum (a channel-split conv paying a 128 MB all-to-all), so other
    starts are polished the same way. ``info["start_cost"]``: the cheapest of them;
    ``info["runner_up"]``: the cheapest plan other than the one returned, if any."""
    now = g.total(sol.choice)
    starts = [s for s in starts if now >= s[2]]
    if sol.optimal or not starts:
        return sol
    cost, edges = g.presolve()
    value = None
    found = [(now, tuple(sol.choice))]
    for start, rounds, _ in starts:
        other, v = start(), None
        # a staged start descends further only while it beats dp's own plan
        for stage in rounds if isinstance(rounds[0], tuple) else (rounds,):
            if v is not None and v >= now:
                break
            other, _ = forest_descent(cost, edges, other, *stage)
            v = g.total(other)
        found.append((v, tuple(other)))
        if value is None or v < value:
            value = v
    # the cheapest plan, and the runner-up distinct from it: the latency polish that
    # follows can reorder them (`search.run`)
    ranked = sorted(found, key=lambda f: f[0])
    info = {**sol.info, "start_cost": value}
    runner = next((c for _, c in ranked[1:] if c != ranked[0][1]), None)
    if runner is not None:
        info["runner_up"] = runner
    best, v = ranked[0][1], ranked[0][0]
    return replace(sol, choice=best, cost=v, memory=g.memory(best), info=info)
