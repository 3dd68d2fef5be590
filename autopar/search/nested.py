"""The search inside an op: a scan's body and a cond's branches, each planned on its
own problem by the driver (`search.search`); `build_problem` prices the plans found.

This is the `NestedSearch` hook `search.build.build_problem` takes, so the problem
module needs neither the driver nor the engines; `search.problem.build_problem`
passes it by default."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

from autopar.cost.model import CostModel
from autopar.errors import MemoryBudgetError
from autopar.ir.graph import Node
from autopar.passes.accumulate import is_accumulation
from autopar.search import search
from autopar.search.build import (
    Branches,
    CondBranches,
    NestedSearch,
    Problem,
    ScanBody,
    batch_like_body_inputs,
    build_problem,
)
from autopar.search.evaluate import output_specs
from autopar.search.layouts import batch_spec, largest_dim, largest_dim_over, max_sharded
from autopar.search.result import SearchResult
from autopar.sharding import MeshInfo, Spec
from autopar.strategies import Fixed, NodeStrategies, fixed_strategy


class SearchNested:
    """The `NestedSearch` in use: a body or branch is built with this same hook (a scan
    in a scan body is searched the same way) and searched by the driver."""

    def scan(
        self,
        node: Node,
        mesh: MeshInfo,
        cost: CostModel,
        stage_axis: str | None = None,
        sums: frozenset[int] = frozenset(),
    ) -> tuple[NodeStrategies, ScanBody]:
        return _scan_strategy(self, node, mesh, cost, stage_axis, sums)

    def cond(
        self, node: Node, mesh: MeshInfo, cost: CostModel
    ) -> tuple[NodeStrategies, CondBranches]:
        return _cond_strategy(self, node, mesh, cost)


search_nested = SearchNested()


def _scan_strategy(
    nested: NestedSearch,
    node: Node,
    mesh: MeshInfo,
    cost: CostModel,
    stage_axis: str | None = None,
    sums: frozenset[int] = frozenset(),
) -> tuple[NodeStrategies, ScanBody]:
    """A scan's strategies: its body searched once (every engine), each distinct plan
    found one strategy of the scan, priced at `length` steps; the outer search picks
    the one that fits its neighbours. The body must fit the device's memory (its
    arguments are the loop's slices, which a free search would leave replicated);
    the carry keeps one spec from step to step through the body's alias edges.
    Each xs/ys value is one body slice with the loop dim in front, unsplit, or split
    over `stage_axis` when the loop is pipelined (`mesh` is then one stage's); a
    pipelined loop's per-layer sums over the batch (body outputs `sums`) may come out
    Partial, summed across devices once after every micro-batch went through."""
    body = build_problem(
        node.body,
        mesh,
        cost,
        partial_carry=is_accumulation(node),
        partial_outputs=sums,
        nested=nested,
    )
    body = replace(body, loop_body=True)
    budget = cost.profile.hbm_bytes
    result = _search_fitting(body, "auto", budget)
    if result.cost.peak_memory_bytes > budget:  # nothing fits: neither need the others
        budget = float("inf")
    candidates = [result.pick(name) for name, _, _ in result.ranked]
    # Plus the layout a loop over layers usually wants: every activation (an input
    # with the carry's leading, batch dim) split along that dim, the rest searched.
    n_fixed = node.params["num_consts"] + node.params["num_carry"]
    n_carry = node.params["num_carry"]
    # the activations: a layer loop's inputs with its carry's batch dim; an accumulation
    # loop's micro-batches (its carry is the gradients, whose leading dims are no batch)
    batched = (
        [i for i in range(n_fixed, body.num_inputs) if body.graph.values[body.graph.inputs[i]].rank]
        if is_accumulation(node)
        else batch_like_body_inputs(node)
    )
    jobs: list[tuple[str, dict[int, int]]] = []  # (name, pins) of the searches below
    if batched:
        pins = {i: _batch_first(body, i) for i in batched}
        jobs.append(("dp+batch", pins))
        # Data parallelism: the other inputs (the layer's weights) and the per-step
        # results without the batch dim (their gradients) whole: each step sums its
        # weight gradients, where a body searched alone leaves them split for free
        batch = body.graph.values[body.graph.inputs[n_fixed - n_carry]].shape[:1]
        summed = tuple(
            None if k < n_carry or t.shape[:1] == batch else Spec.replicated(t.rank)
            for k, t in enumerate(body.graph.values[v] for v in body.graph.outputs)
        )
        with contextlib.suppress(StopIteration):
            whole = {i: _whole(body, i) for i in range(n_fixed, body.num_inputs) if i not in pins}
            jobs.append(("dp+data-parallel", {**_making(body, summed), **pins, **whole}))
            if is_accumulation(node):
                jobs += _zero_bodies(body, node, {**_making(body, summed), **pins})
                jobs += _reduced_each_step(body, node, pins)
        # Per-layer weights split over one axis (Megatron-style when it is the tensor
        # axis): a loop stores its stacked weights in the layout its body reads them,
        # so a body that keeps them whole needs the whole stack on every device.
        for axis, size in zip(mesh.axis_names, mesh.axis_sizes):
            split = {
                i: k
                for i in range(n_fixed, body.num_inputs)
                if i not in pins
                for k in [largest_dim_over(body, i, axis)]
                if k is not None
            }
            if size > 1 and split:
                jobs.append((f"dp+weights/{axis}", {**pins, **split}))
    # And the loop run whole on every device, its results whole too: a body searched
    # alone leaves its per-step results split (free in the body), which its readers
    # after the loop then gather; on a small loop, no collective at all is cheapest.
    outs = tuple(Spec.replicated(body.graph.values[v].rank) for v in body.graph.outputs)
    with contextlib.suppress(StopIteration):  # (an input never whole)
        whole = {i: _whole(body, i) for i in range(body.num_inputs)}
        jobs.append(("dp+whole", {**_making(body, outs), **whole}))
    candidates += _searched(body, budget, jobs)
    lead = (stage_axis,) if stage_axis else ()
    lift = lambda sp: Spec((lead, *sp.dims), sp.partial)
    # one strategy per layout; a layout several candidates found is named by each
    # (`layouts.accumulation_pins` looks the ZeRO bodies up by name)
    names: dict[tuple, list[str]] = {}
    results = []
    for r in candidates:
        ins = [body.strategies[i][r.choice[i]].out_specs[0] for i in range(body.num_inputs)]
        outs = output_specs(body, r.choice)
        in_specs = tuple(sp if k < n_fixed else lift(sp) for k, sp in enumerate(ins))
        out_specs = tuple(sp if k < n_carry else lift(sp) for k, sp in enumerate(outs))
        if (in_specs, out_specs) not in names:
            results.append(r)
        names.setdefault((in_specs, out_specs), []).append(r.engine)
    strategies = [
        fixed_strategy(Fixed(ins, outs, f"scan body: {' = '.join(n)}"))
        for (ins, outs), n in names.items()
    ]
    warnings = tuple(f"{w} (in the scan body at {node.key})" for w in body.warnings)
    return NodeStrategies(tuple(strategies), "; ".join(warnings) or None), (body, results)


def _zero_bodies(body: Problem, node: Node, pins: dict[int, int]) -> list[tuple[str, dict]]:
    """A gradient accumulation loop's ZeRO layouts, the micro-batches split as `pins`
    has them: ZeRO-2 (the weights whole, each accumulated gradient sharded over every
    device, so every micro-batch's sum is reduce-scattered into it: the accumulators
    take 1/N of the memory) and ZeRO-3 (the weights sharded too, gathered for each
    micro-batch's compute). Neither is data parallelism's plan, which keeps both whole;
    the outer search prices them against it, and a memory budget's retries
    (`layouts.loop_pins`) take them where the loop's footprint must shrink."""
    n_consts, n_fixed = (
        node.params["num_consts"],
        node.params["num_consts"] + node.params["num_carry"],
    )
    sharded = {i: max_sharded(body, i) for i in range(n_consts, n_fixed)}
    out = []
    with contextlib.suppress(StopIteration):
        whole = {i: _whole(body, i) for i in range(n_consts) if i not in pins}
        out.append(("dp+zero2", {**pins, **whole, **sharded}))
    weights = {i: max_sharded(body, i) for i in range(n_consts) if i not in pins}
    out.append(("dp+zero3", {**pins, **weights, **sharded}))
    return out


def _reduced_each_step(body: Problem, node: Node, pins: dict[int, int]) -> list[tuple[str, dict]]:
    """A gradient accumulation loop's data parallelism (the micro-batches split as `pins`
    has them, the weights whole) with each micro-batch's gradients summed over the
    devices in the loop (the accumulators whole, not Partial): all-reduces every
    micro-batch, where Partial accumulators are summed once after the loop, where the
    optimizer's reads of each summed gradient can keep XLA from combining them (T5 with
    Adafactor at 2 micro-batches: 112 all-reduces after the loop, 10x the step's time;
    summed in the loop, 65, which XLA does not combine either: 0.821 against 1.233 ms)."""
    n_consts, n_carry = node.params["num_consts"], node.params["num_carry"]
    carries = [i for i in range(n_consts + n_carry) if i not in pins]  # weights, sums
    outs = tuple(
        Spec.replicated(body.graph.values[v].rank) if k < n_carry else None
        for k, v in enumerate(body.graph.outputs)
    )
    with contextlib.suppress(StopIteration):
        whole = {i: _whole(body, i) for i in carries}
        return [("dp+reduced", {**_making(body, outs), **pins, **whole})]
    return []


def _searched(body: Problem, budget: float, jobs: list[tuple[str, dict]]) -> list[SearchResult]:
    """`dp`'s plan of `body` under each job's pins (named by the job), those that fit
    `budget`, in the jobs' order; side by side in forked workers where there are
    several cores (`search.workers`: each search reads only the built body)."""
    from autopar.search import _NoClock
    from autopar.search.workers import run_all, usable

    tasks = {k: functools.partial(_pinned, body, budget, pins) for k, (_, pins) in enumerate(jobs)}
    n = usable(len(body.strategies), len(tasks))
    found = run_all(tasks, n, _NoClock()) if n > 1 else {k: t() for k, t in tasks.items()}
    return [replace(found[k], engine=name) for k, (name, _) in enumerate(jobs) if found[k]]


def _pinned(body: Problem, budget: float, pins: dict[int, int]) -> SearchResult | None:
    try:
        return search(body, "dp", budget, pins)
    except MemoryBudgetError:
        return None


def _search_fitting(problem: Problem, engine: str, budget: float, pins=None) -> SearchResult:
    """`search` within `budget`; when no plan fits, the fastest plan at any size (a loop
    body or branch must be planned whatever it needs; the outer search prices that)."""
    try:
        return search(problem, engine, budget, pins or {})
    except MemoryBudgetError:
        return search(problem, engine, float("inf"), pins or {})


def _cond_strategy(
    nested: NestedSearch, node: Node, mesh: MeshInfo, cost: CostModel
) -> tuple[NodeStrategies, CondBranches]:
    """A cond's strategies: interfaces (operand and result specs) that every branch is
    searched to. The operand specs tried: the inputs of each branch's own plans (every
    engine, the branch searched alone), every operand whole, and every operand with
    its largest dim over one mesh axis. For each, every branch is searched (`dp`) with
    its inputs pinned there; the results come out in the specs the costliest branch
    leaves them in, and the other branches reshard theirs into them. The whole and
    the one-axis operands are also tried with the results laid out the same way (the
    ops that make them pinned so): a branch searched alone splits an elementwise
    update it is handed whole, and the cond's results then need an all-gather each
    (`optax.MultiSteps`' cond in a data-parallel step: one per parameter and moment).
    A strategy is priced at its costliest branch: the search does not know which one
    runs."""
    probs = tuple(build_problem(b, mesh, cost, nested=nested) for b in node.branches)
    p0, n = probs[0], len(node.inputs) - 1
    solve = functools.partial(_search_fitting, budget=cost.profile.hbm_bytes)
    spec_of = lambda p, choice: tuple(p.strategies[i][choice[i]].out_specs[0] for i in range(n))
    # operand specs -> the result specs wanted (None: the costliest branch's own)
    tried: dict[tuple[tuple[Spec, ...], tuple[Spec, ...] | None], None] = {}
    for p in probs:
        for _, choice, _ in solve(p, "auto").ranked:
            tried.setdefault((spec_of(p, choice), None))
    whole = [
        next(k for k, st in enumerate(p0.strategies[i]) if not st.out_specs[0].used_axes)
        for i in range(n)
    ]
    results_of = [p0.graph.values[v] for v in p0.graph.outputs]
    tried.setdefault((spec_of(p0, whole), None))
    tried.setdefault((spec_of(p0, whole), tuple(Spec.replicated(t.rank) for t in results_of)))
    for axis, size in zip(mesh.axis_names, mesh.axis_sizes):
        split = [largest_dim_over(p0, i, axis) for i in range(n)]
        if size > 1 and any(k is not None for k in split):
            ins = spec_of(p0, [w if k is None else k for k, w in zip(split, whole)])
            tried.setdefault((ins, None))
            tried.setdefault((ins, tuple(_largest_dim_spec(t, axis, size) for t in results_of)))
    index = [{st.out_specs[0]: k for k, st in enumerate(p0.strategies[i])} for i in range(n)]
    head = Spec.replicated(0)  # the branch index, a scalar
    strategies, per_strategy, seen = [], [], set()
    for ins, want in tried:
        pins = {i: index[i][sp] for i, sp in enumerate(ins)}
        results = tuple(solve(p, "dp", pins={**pins, **_making(p, want)}) for p in probs)
        worst = max(range(len(probs)), key=lambda k: results[k].cost.step_s)
        outs = want or tuple(output_specs(probs[worst], results[worst].choice))
        if (ins, outs) in seen:
            continue
        seen.add((ins, outs))
        seconds = max(
            r.cost.step_s
            + sum(
                cost.reshard(p.graph.values[v], have, into).seconds
                for v, have, into in zip(p.graph.outputs, output_specs(p, r.choice), outs)
            )
            for p, r in zip(probs, results)
        )
        strategies.append(
            fixed_strategy(Fixed((head, *ins), outs, f"cond: {results[worst].engine}"))
        )
        per_strategy.append(Branches(results, seconds))
    warnings = tuple(
        f"{w} (in the cond branch {k} at {node.key})"
        for k, p in enumerate(probs)
        for w in p.warnings
    )
    return NodeStrategies(tuple(strategies), "; ".join(warnings) or None), (
        probs,
        tuple(per_strategy),
    )


def _largest_dim_spec(t, axis: str, size: int) -> Spec:
    """`t` split on its largest dim over `axis` where `size` divides it, else whole."""
    d = largest_dim(t)
    if d is None or t.shape[d] % size:
        return Spec.replicated(t.rank)
    return Spec(tuple((axis,) if k == d else () for k in range(t.rank)))


def _whole(problem: Problem, i: int) -> int:
    """Input i's strategy that keeps it whole (StopIteration where it has none)."""
    return next(k for k, st in enumerate(problem.strategies[i]) if not st.out_specs[0].used_axes)


def _making(problem: Problem, want: tuple[Spec, ...] | None) -> dict[int, int]:
    """Pins that make each result of a branch in the spec `want` has for it: its
    producing op's strategy that makes it so, where the op has one (a result that is
    an operand passed through keeps the operand's pin)."""
    pins: dict[int, int] = {}
    for v, sp in zip(problem.graph.outputs, want or ()):
        u, k = problem.source.get(v, (None, 0))
        if u is None or u < problem.num_inputs or u in pins:
            continue
        s = next((j for j, st in enumerate(problem.strategies[u]) if st.out_specs[k] == sp), None)
        if s is not None:
            pins[u] = s
    return pins


def _batch_first(problem: Problem, i: int) -> int:
    """Input i's strategy with its leading (batch) dim split over as many axes as divide
    it, and the axes left over on its other dims (the most devices, fewest dims)."""
    lead = problem.strategies[i][batch_spec(problem, i)].out_specs[0].dims[0]
    same = [k for k, s in enumerate(problem.strategies[i]) if s.out_specs[0].dims[0] == lead]
    key = lambda k: (
        problem.strategies[i][k].parallel,
        -sum(bool(d) for d in problem.strategies[i][k].out_specs[0].dims),
        -k,
    )
    return max(same, key=key)
