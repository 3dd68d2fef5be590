"""A multi-axis mesh's plans include every plan of the mesh with its axes merged into one.

On `{"data": 2, "model": 4}`, a dim split 8 ways over `("data", "model")` is a plan of
`{"data*model": 8}` as well: the same shards on the same devices, the same collectives
over the same groups. The engines search a 2- or 3-axis mesh's large strategy tables
heuristically and can miss such a plan: a linen MLP at batch 2 was planned at 0.0634
ms on `{"data": 2, "model": 4}` where its plan on an 8-device 1-D mesh, a plan of the
2-D mesh too, prices at 0.0508 (an NNX ViT: 0.133 against 0.043 ms). So on a mesh the
user gives, `auto` also searches the merged 1-D mesh with `dp` (its tables are small)
and offers that plan, its axes spelled out, as one more candidate (`search`'s seeds),
polished and priced on the user's mesh like the engines' plans (docs/features.md); so
does a mesh-shape search (`mesh=N`) on each shape of two or more axes, from one plan of
the merged mesh (a trial's 8B step: 1952 ms on `mesh=64` where `{"data": 8, "model":
8}` gives 1385 with it)."""

from __future__ import annotations

from collections.abc import Sequence

from autopar.cost.model import CostModel
from autopar.errors import AutoparError
from autopar.ir.graph import Graph
from autopar.search import ENGINES, Seed
from autopar.search.problem import Problem, build_problem
from autopar.search.result import SolverInfo
from autopar.sharding import MeshInfo, Spec


def merged_seeds(graph: Graph, problem: Problem) -> dict[str, Seed]:
    """{the seed's name: the `search.Seed` that makes `problem`'s plan from the merged
    mesh's `dp` plan}, or {} where it does not apply: a mesh with fewer than two axes of
    size > 1, a graph with loops or conds (their bodies would be searched again on the
    merged mesh)."""
    mesh = problem.mesh
    run = tuple(a for a, n in zip(mesh.axis_names, mesh.axis_sizes) if n > 1)
    if len(run) < 2 or any(n.body is not None or n.branches is not None for n in graph.nodes):
        return {}
    name = "*".join(run)

    def seed(info: SolverInfo) -> list[int] | None:
        got = _merged_plan(graph, problem, name)
        if isinstance(got, str):  # a sharding constraint naming the user's axes, say
            info["not_applied"] = got
            return None
        coarse, choice = got
        return _spelled_out(coarse, choice, problem, {coarse.mesh.axis_names[0]: run}, info)

    return {f"dp@{name}": seed}


def _merged_plan(graph: Graph, problem: Problem, name: str) -> tuple[Problem, list[int]] | str:
    """The merged mesh's problem and its `dp` plan, once per graph, devices and profile
    (a mesh-shape search's shapes of two or more axes all merge into the same 1-D mesh,
    named after the first), or why it has none."""
    mesh = problem.mesh
    held = graph.__dict__.setdefault("_merged_plans", {})
    key = (mesh.device_ids, mesh.devices_per_node, problem.cost.profile)
    if key not in held:
        merged = MeshInfo.build(
            (name,), (mesh.num_devices,), mesh.device_ids, mesh.devices_per_node
        )
        try:
            coarse = build_problem(graph, merged, CostModel(problem.cost.profile, merged))
        except AutoparError as e:
            held[key] = str(e).splitlines()[0]
        else:
            held[key] = (coarse, ENGINES["dp"](coarse, {}, {}))
    return held[key]


def _spelled_out(
    coarse: Problem,
    choice: Sequence[int],
    fine: Problem,
    runs: dict[str, tuple[str, ...]],
    info: SolverInfo,
) -> list[int] | None:
    """`choice` on `coarse` as a plan of `fine` (the same graph on a mesh whose axes
    `runs` merged): each node's strategy whose specs are the chosen one's with every
    merged axis spelled out as its run. None if some node has no such strategy."""

    def spell(spec: Spec) -> Spec:
        dims = tuple(tuple(a for x in d for a in runs.get(x, (x,))) for d in spec.dims)
        return Spec(dims, tuple(a for x in spec.partial for a in runs.get(x, (x,))))

    index: dict[int, dict] = {}  # a fine strategy table -> {(in specs, out specs): index}
    out = []
    for v, s in enumerate(choice):
        table = fine.strategies[v]
        by_specs = index.get(id(table))
        if by_specs is None:
            by_specs = index[id(table)] = {}
            for i, st in enumerate(table):
                by_specs.setdefault((st.in_specs, st.out_specs), i)
        st = coarse.strategies[v][s]
        got = by_specs.get((tuple(map(spell, st.in_specs)), tuple(map(spell, st.out_specs))))
        if got is None:
            info["not_applied"] = f"no strategy of node {v} on the mesh reads {st.name} spelled out"
            return None
        out.append(got)
    return out
