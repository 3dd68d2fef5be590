"""`autopar explain`: why an op got its strategy.

`explain_op` reads the plan alone; `explain_alternatives` prices every strategy the op
could have had on the search problem rebuilt from the traced function
(`rebuild_problem`), with the rest of the plan fixed, through the engines' own
cost-graph tables."""

from __future__ import annotations

import inspect as pyinspect
import linecache
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.errors import PlanError, format_bytes
from autopar.plan.plan import Plan
from autopar.plan.records import OpRecord
from autopar.tools.inspect.format import (
    format_delta_bytes,
    format_delta_seconds,
    format_seconds,
    layer_of_op,
    phase_of_op,
)

MAX_EXPLAINED = 12  # ops one query may explain at once
_SOURCE_RE = re.compile(r"^(?P<file>[^:]+\.py):(?P<line>\d+)$")


def find_ops(plan: Plan, query: str) -> list[int]:
    """Op indices for `query`: an exact op key; a source location `file.py:LINE` (every
    op it produced); else a substring of op keys (or of sources) that must be unique.
    Raises PlanError naming the candidates when nothing or too much matches."""
    keys = [o.key for o in plan.ops]
    if query in keys:
        return [keys.index(query)]
    if _SOURCE_RE.match(query):
        # the user's line first (`source`), else the library line (`library_source`)
        for field in ("source", "library_source"):
            hits = [i for i, o in enumerate(plan.ops) if getattr(o, field, "") == query]
            if not hits:
                hits = [
                    i
                    for i, o in enumerate(plan.ops)
                    if getattr(o, field, "").endswith("/" + query)
                    or query.endswith("/" + getattr(o, field, "<none>"))
                ]
            if hits:
                return hits
    hits = [i for i, k in enumerate(keys) if query in k]
    if not hits:
        hits = [i for i, o in enumerate(plan.ops) if query in o.source]
    if len(hits) == 1:
        return hits
    if not hits:
        raise PlanError(
            f"no op matches {query!r}: give an op key (see `autopar inspect --by op`), "
            "a unique part of one, or a source location like gpt.py:99"
        )
    shown = ", ".join(keys[i] for i in hits[:8])
    raise PlanError(
        f"{query!r} matches {len(hits)} ops ({shown}{', ...' if len(hits) > 8 else ''}); "
        "give more of the key"
    )


def source_text(source: str, search_dirs: Sequence[str] = ()) -> str | None:
    """The text of `file.py:LINE`, found among loaded modules or in `search_dirs`."""
    m = _SOURCE_RE.match(source)
    if not m:
        return None
    base, line = os.path.basename(m.group("file")), int(m.group("line"))
    paths = []
    for d in search_dirs:
        p = os.path.join(d, base)
        if os.path.isfile(p):
            paths.append(os.path.abspath(p))
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and os.path.basename(f) == base:
            paths.append(os.path.abspath(f))
    paths = list(dict.fromkeys(paths))
    found = [(p, linecache.getline(p, line).strip()) for p in paths]
    found = [(p, t) for p, t in found if t]
    if len(found) == 1:
        return f"{found[0][0]}:{line}: {found[0][1]}"
    if found:  # several files of that name: each candidate, not the first silently
        return f"one of {len(found)} files named {base}:" + "".join(
            f"\n              {p}:{line}: {t}" for p, t in found
        )
    return None


def explain_op(plan: Plan, i: int, search_dirs: Sequence[str] = (), graph=None) -> list[str]:
    """The op's record in words; with the traced `graph`, its operand and result types."""
    o: OpRecord = plan.ops[i]
    node = graph.nodes[i] if graph is not None and i < len(graph.nodes) else None
    types_in = [str(graph.values[v]) for v in node.inputs] if node is not None else []
    types_out = [str(graph.values[v]) for v in node.outputs] if node is not None else []
    lines = [
        f"op {o.key}",
        f"  primitive {o.op}, layer {layer_of_op(o.key)}, {phase_of_op(o.key)} pass",
        f"  source    {o.source}"
        + (f" (through {o.library_source})" if getattr(o, "library_source", "") else ""),
    ]
    for src in (o.source, getattr(o, "library_source", "")):
        text = source_text(src, search_dirs) if src else None
        if text:
            lines.append(f"            {text}")
    lines.append(f"  strategy  {o.strategy}")
    for j, s in enumerate(o.in_specs):
        t = f"{types_in[j]}  " if j < len(types_in) else ""
        lines.append(f"  in[{j}]     {t}{s}   {s.to_json()}")
    for j, s in enumerate(o.out_specs):
        t = f"{types_out[j]}  " if j < len(types_out) else ""
        lines.append(f"  out[{j}]    {t}{s}   {s.to_json()}")
    lines.append(f"  compute   {format_seconds(o.compute_s)}")
    return lines


@dataclass(frozen=True)
class Alternative:
    index: int
    name: str
    compute_s: float
    reshard_s: float
    memory_bytes: float
    chosen: bool
    worst: list[str]  # the costliest reshards against the neighbours, described

    @property
    def total_s(self) -> float:
        return self.compute_s + self.reshard_s


def plan_choice(problem, plan: Plan) -> tuple[list[int | None], list[str]]:
    """The plan's strategy index per cost-graph node of `problem` (None where the plan's
    strategy is not among those enumerated now), and notes about such mismatches."""
    notes = []
    choice: list[int | None] = []
    for r, strats in zip(plan.inputs, problem.strategies[: problem.num_inputs]):
        idx = next((k for k, s in enumerate(strats) if s.out_specs[0] == r.spec), None)
        choice.append(idx)
    for o, strats in zip(plan.ops, problem.strategies[problem.num_inputs :]):
        idx = next(
            (
                k
                for k, s in enumerate(strats)
                if s.name == o.strategy
                and tuple(s.in_specs) == o.in_specs
                and tuple(s.out_specs) == o.out_specs
            ),
            None,
        )
        if idx is None:
            idx = next((k for k, s in enumerate(strats) if s.name == o.strategy), None)
        choice.append(idx)
    missing = sum(c is None for c in choice)
    if missing:
        notes.append(
            f"{missing} nodes' planned strategies are not among the strategies enumerated now "
            "(the strategy rules changed since the plan was made?); their edges are left out"
        )
    return choice, notes


def _node_name(problem, plan: Plan, u: int) -> str:
    if u < problem.num_inputs:
        return plan.inputs[u].path
    return plan.ops[u - problem.num_inputs].key


def _edge_collectives(problem, choice, v: int, s: int) -> dict[int, list]:
    """Collectives on each edge of node v when v takes strategy s and its neighbours
    keep `choice`: neighbour cost-graph node -> [Collective]."""
    g, n_in = problem.graph, problem.num_inputs
    strats = problem.strategies
    out: dict[int, list] = {}
    if v >= n_in:
        node = g.nodes[v - n_in]
        for j, x in enumerate(node.inputs):
            if x not in problem.source:
                continue
            u, k = problem.source[x]
            if choice[u] is None:
                continue
            r = problem.cost.reshard(
                g.values[x], strats[u][choice[u]].out_specs[k], strats[v][s].in_specs[j]
            )
            out.setdefault(u, []).extend(r.collectives)
        outs = node.outputs
    else:
        outs = (g.inputs[v],)
    for k, x in enumerate(outs):
        for w in g.consumers.get(x, ()):
            cw = n_in + w
            if choice[cw] is None:
                continue
            for j, y in enumerate(g.nodes[w].inputs):
                if y == x:
                    r = problem.cost.reshard(
                        g.values[x], strats[v][s].out_specs[k], strats[cw][choice[cw]].in_specs[j]
                    )
                    out.setdefault(cw, []).extend(r.collectives)
    return out


def explain_alternatives(problem, plan: Plan, i: int) -> tuple[list[Alternative], list[str]]:
    """Every strategy op `i` could take, priced with the rest of the plan fixed: its
    compute time plus the resharding against its neighbours' chosen strategies (the
    cost-graph edges, as the engines see them). Sorted cheapest first."""
    from autopar.search.engines import edge_sum, neighbour_tables

    choice, notes = plan_choice(problem, plan)
    v = problem.num_inputs + i
    nb = neighbour_tables(problem)
    decided = np.array([c is not None for c in choice])
    filled = [c if c is not None else 0 for c in choice]
    strats = problem.strategies[v]
    reshard = edge_sum(nb[v], filled, decided, len(strats))
    alts = []
    for s, st in enumerate(strats):
        per_nb = {}
        for u, m in nb[v]:
            if decided[u]:
                per_nb[u] = per_nb.get(u, 0.0) + float(m[filled[u]][s])
        worst = []
        colls = _edge_collectives(problem, choice, v, s)
        for u, t in sorted(per_nb.items(), key=lambda kv: -kv[1])[:3]:
            if t <= 0:
                continue
            desc = ", ".join(
                f"{c.kind}@{','.join(c.axes)} {format_bytes(c.bytes)}" for c in colls.get(u, ())
            )
            worst.append(
                f"{format_seconds(t)} against {_node_name(problem, plan, u)}"
                + (f" ({desc})" if desc else "")
            )
        alts.append(
            Alternative(
                s,
                st.name,
                float(problem.node_time[v][s]),
                float(reshard[s]),
                float(problem.node_mem[v][s]),
                s == choice[v],
                worst,
            )
        )
    alts.sort(key=lambda a: (a.total_s, not a.chosen, a.index))
    if choice[v] is None:
        notes.append("the plan's strategy for this op is not among those enumerated now")
    return alts, notes


def render_alternatives(alts: list[Alternative], engine: str) -> list[str]:
    chosen = next((a for a in alts if a.chosen), None)
    lines = [
        f"  {len(alts)} strategies, priced with every other node as planned "
        "(compute + resharding against the neighbours' chosen strategies):",
    ]
    w = max((len(a.name) for a in alts), default=8)
    lines.append(
        f"    {'strategy':<{w}}  {'compute':>10}  {'reshard':>10}  {'total':>10}  {'memory':>10}"
    )
    for a in alts:
        mark = "  <- chosen" if a.chosen else ""
        lines.append(
            f"    {a.name:<{w}}  {format_seconds(a.compute_s):>10}  {format_seconds(a.reshard_s):>10}  "
            f"{format_seconds(a.total_s):>10}  {format_bytes(a.memory_bytes):>10}{mark}"
        )
    if chosen is None:
        return lines
    if chosen.worst:
        lines.append("  the chosen strategy pays:")
        lines += [f"        {w}" for w in chosen.worst]
    lines.append("  why the others lost:")
    for a in alts:
        if a.chosen:
            continue
        d = a.total_s - chosen.total_s
        dm = a.memory_bytes - chosen.memory_bytes
        mem = f"; output memory {format_delta_bytes(dm)}/device" if dm else ""
        if d > 0:
            parts = []
            if a.compute_s != chosen.compute_s:
                parts.append(f"compute {format_delta_seconds(a.compute_s - chosen.compute_s)}")
            if a.reshard_s != chosen.reshard_s:
                parts.append(f"resharding {format_delta_seconds(a.reshard_s - chosen.reshard_s)}")
            why = "; ".join(parts)
            lines.append(f"    {a.name}: {format_delta_seconds(d)} ({why}){mem}")
        else:
            lines.append(
                f"    {a.name}: {'as cheap' if d == 0 else f'cheaper by {format_seconds(-d)}'} here, "
                f"but engine {engine} chose for the whole graph (costs it moves elsewhere, "
                f"the memory budget, or pinned baselines){mem}"
            )
        for wline in a.worst:
            lines.append(f"        {wline}")
    return lines


# ---------------------------------------------------------------------------- the command


def rebuild_problem(
    plan: Plan,
    target: str,
    dirs: list[str],
    prepare_backend: Callable[[int], None] | None = None,
):
    """Trace TARGET, check it is the plan's function, and rebuild its search problem.
    `prepare_backend(num_devices)` runs before the trace when the trace needs a mesh.
    Returns the problem and `dirs` plus the function's source directory."""
    import cost_models
    from autopar.api import bind_plan
    from autopar.cost.model import CostModel
    from autopar.frontends import bind
    from autopar.ir.capture import capture
    from autopar.search.problem import build_problem
    from autopar.tools.workload import load_target

    wl = load_target(target)
    kw = {}
    if "mesh" in pyinspect.signature(capture).parameters:
        # Bare PartitionSpecs in the function's own sharding constraints need a mesh.
        if prepare_backend is not None:
            prepare_backend(plan.mesh.num_devices)
        from autopar.meshes import make_mesh

        kw["mesh"] = make_mesh(plan.mesh.shape)
    # through the frontend, as `parallelize` traces it (NNX modules as their state)
    bound = bind(
        wl.fn,
        tuple(wl.args),
        {},
        static_argnums=wl.static_argnums,
        static_argnames=(),
        donate_argnums=(),
        in_specs=None,
    )
    graph = capture(bound.program, bound.args, bound.static, keywords=bound.program.keywords, **kw)
    graph = _as_planned(plan, graph)
    bind_plan(plan, graph, plan.mesh, None)  # raises PlanError naming what differs
    profile = cost_models.ClusterProfile.from_dict(plan.cluster)
    problem = build_problem(graph, plan.mesh, CostModel(profile, plan.mesh))
    code = getattr(wl.fn, "__code__", None)
    if code is not None:
        dirs = [*dirs, os.path.dirname(code.co_filename)]
    return problem, dirs


def _as_planned(plan: Plan, graph):
    """The traced step through the passes the plan records (mixed precision, remat) as
    the search saw it; remat's data ordering where the compiler drops barriers (a plan
    made on CPU devices) is tried where the plain rewrite does not match."""
    from autopar.passes.precision import mixed_precision
    from autopar.passes.remat import rematerialize
    from autopar.plan.plan import fingerprint

    if plan.precision is not None:
        graph = mixed_precision(graph, plan.precision)
    if plan.remat is None:
        return graph
    got = graph
    for wait in (False, True):
        got, _ = rematerialize(graph, plan.remat, plan.remat_layers, wait_for_gradients=wait)
        if fingerprint(got) == plan.fingerprint:
            break
    return got


def explain(
    plan: Plan,
    plan_path: str,
    query: str,
    target: str | None = None,
    prepare_backend: Callable[[int], None] | None = None,
) -> None:
    """Print `autopar explain`: the ops `query` names (see `find_ops`) and, with TARGET,
    every alternative strategy priced against the planned neighbours."""
    hits = find_ops(plan, query)
    if len(hits) > MAX_EXPLAINED:
        # a model's line makes an op per layer, forward and backward: the costliest one
        # is explained, the others named
        top = max(hits, key=lambda i: (plan.ops[i].compute_s, -i))
        keys = [plan.ops[i].key for i in hits if i != top]
        shown = "\n  ".join(keys[:MAX_EXPLAINED])
        more = f"\n  ... and {len(keys) - MAX_EXPLAINED} more" if len(keys) > MAX_EXPLAINED else ""
        print(
            f"{query!r} matches {len(hits)} ops; explaining the costliest, "
            f"{plan.ops[top].key} (give another's key to explain it; `autopar inspect "
            f"{plan_path} --by op` lists them all):\n  {shown}{more}\n"
        )
        hits = [top]
    dirs = [os.getcwd()]
    problem = None
    if target:
        problem, dirs = rebuild_problem(plan, target, dirs, prepare_backend)
    for n, i in enumerate(hits):
        if n:
            print()
        print("\n".join(explain_op(plan, i, dirs, problem.graph if problem else None)))
        if problem is not None:
            alts, notes = explain_alternatives(problem, plan, i)
            print("\n".join(render_alternatives(alts, plan.engine)))
            for note in notes:
                print(f"  note: {note}")
    if problem is None:
        print("\n(pass --target TARGET to price every alternative strategy for this op)")
