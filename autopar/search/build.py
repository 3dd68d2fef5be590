"""The search problem: a cost graph over strategy choices.

Cost-graph nodes are the function's inputs (their strategies are the specs an
argument can take) followed by the graph's ops. Edges carry resharding
matrices; an argument whose updated value is returned (params, optimizer
state) gets an extra edge from the op producing the new value back to the
argument, so both keep one sharding. Every engine works on this one object.

What nests inside an op (a scan's body, a cond's branches) is planned by a search
over its own problem; `build_problem` takes that search as a hook (`NestedSearch`,
`search.nested` the one every caller uses, through `search.problem.build_problem`),
so this module stays below the engines and the driver that run it.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import jax.numpy as jnp
import numpy as np

from autopar.cost.model import CostModel, node_flops, rate_dtype
from autopar.ir.graph import Graph, Node, TensorType, find_aliases
from autopar.passes.pipeline import SUM, PipelinedScans, sub_mesh
from autopar.passes.zero_bubble import split_weight_grads
from autopar.search.edges import (
    add_edge,
    bucket_share,
    build_edges,
    chained,
    combinable_values,
    reshard_matrix,
    reshard_seconds,
)
from autopar.search.facts import (
    flops_each,
    hbm_traffic,
    node_facts,
    node_kinds,
    run_flops,
)
from autopar.search.piped import alternating_waits, loop_times, pipeline_buffers, residency
from autopar.search.result import SearchResult
from autopar.search.solvers.costgraph import CostGraph
from autopar.sharding import MeshInfo, Spec
from autopar.strategies import (
    Factor,
    FactorRule,
    NodeStrategies,
    Strategy,
    enumerate_factor_rule,
    strategies_for,
)


@dataclass(frozen=True)
class Branches:
    """One strategy of a cond: each branch's plan, its inputs pinned to the cond's
    operand specs; `seconds` is the costliest branch's step with the reshard of its
    results into the cond's result specs."""

    results: tuple[SearchResult, ...]  # one per branch
    seconds: float


# A scan's body problem and one plan of it per scan strategy; a cond's branch problems
# and one `Branches` per cond strategy.
ScanBody = tuple["Problem", Sequence[SearchResult]]
CondBranches = tuple[tuple["Problem", ...], tuple[Branches, ...]]


class NestedSearch(Protocol):
    """The hook `build_problem` plans nested graphs with: each method returns the
    op's strategies (one per plan of what it nests) and those plans, which
    `build_problem` prices (a scan at `length` steps or as a pipeline, a cond at its
    costliest branch). `search.nested.search_nested` is the one in use."""

    def scan(
        self,
        node: Node,
        mesh: MeshInfo,
        cost: CostModel,
        stage_axis: str | None = None,
        sums: frozenset[int] = frozenset(),
    ) -> tuple[NodeStrategies, ScanBody]: ...

    def cond(
        self, node: Node, mesh: MeshInfo, cost: CostModel
    ) -> tuple[NodeStrategies, CondBranches]: ...


@dataclass(frozen=True, eq=False)
class Problem:
    graph: Graph
    mesh: MeshInfo
    cost: CostModel
    strategies: tuple[tuple[Strategy, ...], ...]  # per cost-graph node
    source: dict[int, tuple[int, int]]  # value id -> (cost-graph node, output index)
    aliases: dict[int, int]  # output position -> input position (state round trip)
    warnings: tuple[str, ...]
    flops: np.ndarray  # per cost-graph node, total FLOPs
    node_time: tuple[np.ndarray, ...]
    node_mem: tuple[np.ndarray, ...]
    edges: dict[tuple[int, int], np.ndarray] = field(repr=False)
    # scan node id -> (its body's problem, one body SearchResult per scan strategy)
    bodies: dict[int, ScanBody] = field(default_factory=dict, repr=False)
    # output positions returned as the Partial sums they are (a pipelined loop body's
    # weight gradients, summed over micro-batches before anyone sums across devices)
    partial_outputs: frozenset[int] = frozenset()
    # value id -> the fraction of it alive at once (a 1F1B pipeline's saved activations
    # and head values, which exist a few micro-batches at a time)
    resident: dict[int, float] = field(default_factory=dict)
    # cond node id -> (its branches' problems, one Branches per cond strategy)
    conds: dict[int, CondBranches] = field(default_factory=dict, repr=False)
    # per cost-graph node, `node_time` less the all-reduce of a Partial value the
    # function returns (the search's objective charges it to the producer, bucketed;
    # the final price counts it where `evaluate.edge_collectives` finds it)
    node_compute: tuple[np.ndarray, ...] | None = field(default=None, repr=False)
    # the share of one latency a combinable all-reduce pays (`search.edges.bucket_share`)
    bucket_share: float = 1.0
    # input positions the caller donates: an output that updates one is written into
    # its buffer, not a copy of its own (`memory.peak_memory`)
    donated: frozenset[int] = frozenset()
    # a loop's body: every step runs it, so repeated layers in it have no ends that
    # touch an embedding or a head (`search.layers` folds all of them into one)
    loop_body: bool = False
    # (forward loop, backward loop, seconds by their two strategies): what the
    # alternating 1F1B schedule adds to the two loops' own prices, the wait of the
    # faster pass for the slower in each slot (`alternating_waits`); in `edges` too
    waits: tuple[tuple[int, int, np.ndarray], ...] = field(default=(), repr=False)
    # the graph node ids of each 1F1B region (forward loop, head, backward loop), which
    # run as one loop: what any of them reads or makes is alive for all of it
    regions: tuple[frozenset[int], ...] = ()
    # graph node id of a pipelined loop -> bytes by its strategy that its pipeline
    # holds for the whole of its 1F1B region beyond the values above (ZB-H1: what the
    # deferred weight gradients read; interleaved: the weights in chunk order;
    # `piped.pipeline_buffers`)
    buffers: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    # graph node id of a loop -> by its strategy, the communication inside its price
    # (seconds, bytes per device by "kind@axes"): its body's collectives every step (and
    # a pipeline's hops), which `evaluate` counts as communication, not compute
    loop_comm: dict[int, tuple[tuple[float, dict[str, int]], ...]] = field(
        default_factory=dict, repr=False
    )

    # per cost-graph node, how many nodes of the step it stands for (a problem
    # `search.fold` folded: a representative of its merged copies); None: one each
    copies: np.ndarray | None = field(default=None, repr=False)

    def compute_time(self) -> tuple[np.ndarray, ...]:
        return self.node_time if self.node_compute is None else self.node_compute

    def wait_time(self, choice: Sequence[int], nodes: Collection[int] | None = None) -> float:
        """The alternating schedule's waits (`waits`) under `choice`: of every pair, or
        of the pairs with a loop in `nodes`."""
        return sum(
            float(w[choice[u], choice[v]])
            for u, v, w in self.waits
            if nodes is None or u in nodes or v in nodes
        )

    @property
    def num_inputs(self) -> int:
        return len(self.graph.inputs)

    def op_index(self, cg_node: int) -> int:
        return cg_node - self.num_inputs

    def cost_graph(self) -> CostGraph:
        """The cost graph of the tables, made once (its arrays are checked as made)."""
        made = self.__dict__.get("_cost_graph")
        if made is None:
            made = CostGraph(self.node_time, self.node_mem, self.edges)
            object.__setattr__(self, "_cost_graph", made)
        return made

    def neighbours(self) -> list[list[int]]:
        nb: list[list[int]] = [[] for _ in self.strategies]
        for u, v in self.edges:
            nb[u].append(v)
            nb[v].append(u)
        return nb


def input_strategies(t: TensorType, mesh: MeshInfo, partial: bool = False) -> tuple[Strategy, ...]:
    """An argument may be sharded along any dims the mesh axes divide; with `partial`,
    also be a Partial sum over any set of the axes a sharding leaves unused."""
    rule = FactorRule(tuple(Factor(s) for s in t.shape), (), (tuple(range(t.rank)),))
    out = enumerate_factor_rule(rule, mesh)
    if partial and jnp.issubdtype(t.dtype, jnp.floating):
        for s in list(out):
            free = [
                a for a in mesh.axis_names if a not in s.out_specs[0].used_axes and mesh.size(a) > 1
            ]
            for k in range(1, len(free) + 1):
                for axes in itertools.combinations(free, k):
                    spec = Spec(s.out_specs[0].dims, axes)
                    out.append(replace(s, out_specs=(spec,)))
    return tuple(out)


def _rolled_groups(pipelined: PipelinedScans | None) -> frozenset[int]:
    """The inputs of a rolled graph that group one leaf of every stage's layer."""
    roll = pipelined.roll if pipelined is not None else None
    return frozenset(i for i, ms in enumerate(roll.inputs) if len(ms) > 1) if roll else frozenset()


def _stage_major(strategies: tuple[Strategy, ...], axis: str) -> tuple[Strategy, ...]:
    """The strategies that split dim 0 over `axis` first (each stage's rows its own)."""
    return tuple(s for s in strategies if s.out_specs[0].dims[0][:1] == (axis,))


# Node strategies kept across builds, per mesh: the tries of one call (micro-batch counts,
# remat policies, stage counts) build problems on a few meshes, and a node's strategies
# depend on its op, types and params (`facts.node_key`) and the mesh alone. On the scanned
# GPT-3 175B pipeline search, 52 builds asked `strategies_for` 33.6k times. Those with a
# warning (which names one op) stay per build. At most MAX_MESHES meshes are kept, and
# MAX_NODES node kinds a mesh (a process planning many models starts a mesh's afresh).
MAX_MESHES = 4
MAX_NODES = 20_000
_STRATEGIES: collections.OrderedDict[MeshInfo, dict] = collections.OrderedDict()


def _strategies_on(mesh: MeshInfo) -> dict:
    got = _STRATEGIES.get(mesh)
    if got is None or len(got) > MAX_NODES:
        got = _STRATEGIES[mesh] = {}
    _STRATEGIES.move_to_end(mesh)
    while len(_STRATEGIES) > MAX_MESHES:
        _STRATEGIES.popitem(last=False)
    return got


def build_problem(
    graph: Graph,
    mesh: MeshInfo,
    cost: CostModel,
    pipelined: PipelinedScans | None = None,
    partial_carry: bool = False,
    partial_outputs: frozenset[int] = frozenset(),
    *,
    nested: NestedSearch,
) -> Problem:
    """The cost graph of `graph` on `mesh`, scan bodies and cond branches planned by
    `nested`. The scans in `pipelined` have their body searched at the micro-batch
    size on one stage's sub-mesh and are priced as a GPipe pipeline over the stage
    axis. With `partial_carry` (the body of a gradient
    accumulation loop), a state input that comes back as an output may also be a
    Partial sum, kept unsummed from step to step. The outputs at `partial_outputs` may
    be returned unsummed."""
    piped = pipelined.scans if pipelined is not None else {}
    head = pipelined.head_nodes() if pipelined is not None else frozenset()
    resident = residency(graph, pipelined)
    carried = set(find_aliases(graph).values()) if partial_carry else set()
    n_in = len(graph.inputs)
    strategies: list[tuple[Strategy, ...]] = []
    warnings: list[str] = []
    source: dict[int, tuple[int, int]] = {}
    flops = np.zeros(n_in + len(graph.nodes))
    cache: dict = {}
    shared = _strategies_on(mesh)
    groups = _rolled_groups(pipelined)
    for i, v in enumerate(graph.inputs):
        t = graph.values[v]
        key = ("input", t, i in carried, i in groups)
        if key not in cache:
            cache[key] = input_strategies(t, mesh, partial=i in carried)
            if i in groups:  # each stage holds its own layers' leaf (`autopar.lower.rolled`)
                cache[key] = _stage_major(cache[key], pipelined.pipe.axis)
        strategies.append(cache[key])
        source[v] = (i, 0)
    bodies: dict[int, ScanBody] = {}
    conds: dict[int, CondBranches] = {}
    keys, node_flops_of = graph.memo(node_facts)
    for node in graph.nodes:
        key = keys[node.id]
        ns = cache.get(key) if key is not None else None
        if node.id in piped:
            sub = sub_mesh(mesh, pipelined.pipe.axis)
            micro, labels = piped[node.id]
            n_k = node.params["num_carry"]
            sums = frozenset(n_k + j for j, lab in enumerate(labels.outs[n_k:]) if lab == SUM)
            ns, bodies[node.id] = nested.scan(
                replace(node, body=micro),
                sub,
                CostModel(cost.profile, sub),
                pipelined.pipe.axis,
                sums,
            )
        elif node.body is not None:
            ns, bodies[node.id] = nested.scan(node, mesh, cost)
        elif node.branches is not None:
            ns, conds[node.id] = nested.cond(node, mesh, cost)
        elif ns is None:
            ns = shared.get(key) if key is not None else None
            if ns is None:
                ns = strategies_for(node, graph, mesh)
                if key is not None and ns.warning is None:
                    shared[key] = ns
            if key is not None:
                cache[key] = ns
        if node.id in head:  # runs on the last stage, micro-batch by micro-batch
            axis = pipelined.pipe.axis
            off_stage = tuple(
                s
                for s in ns.strategies
                # (nor a sum over it pending: summed, it would be split over the axis)
                if not any(
                    axis in sp.used_axes or axis in sp.partial for sp in (*s.in_specs, *s.out_specs)
                )
            )
            ns = replace(ns, strategies=off_stage or ns.strategies)
        if ns.warning:
            warnings.append(ns.warning)
        strategies.append(ns.strategies)
        for k, v in enumerate(node.outputs):
            source[v] = (n_in + node.id, k)

    flops[n_in:] = node_flops_of
    combinable = combinable_values(graph)
    after = chained(graph, strategies, combinable)
    share = bucket_share(graph, tuple(strategies), combinable, after)
    node_time, node_mem, node_comm = _node_costs(
        graph, mesh, cost, strategies, flops, carried, partial_outputs, resident, share
    )
    node_time, node_comm = list(node_time), list(node_comm)
    for i in (*bodies, *conds):  # priced whole by their nested plans below
        node_comm[n_in + i] = np.zeros(len(strategies[n_in + i]))
    piped_times, loop_comm = (
        loop_times(graph, pipelined, bodies, cost) if pipelined is not None else ({}, {})
    )
    for i, (_, results) in bodies.items():
        node = graph.nodes[i]
        if i in piped_times:
            node_time[n_in + i] = piped_times[i]
        else:
            n = node.params["length"]
            node_time[n_in + i] = np.array([n * r.cost.step_s for r in results])
            loop_comm[i] = tuple(
                (n * r.cost.comm_s, {k: n * b for k, b in r.cost.comm_bytes.items()})
                for r in results
            )
    waits = alternating_waits(graph, pipelined, bodies, cost) if pipelined is not None else ()
    buffers = pipeline_buffers(graph, pipelined, bodies) if pipelined is not None else {}
    for i, (body, results) in bodies.items():
        if i not in piped_times:  # (a pipelined loop's memory is its region's)
            buffers[i] = np.array([_scratch(body, r) for r in results], dtype=np.float64)
    node_mem = tuple(  # the engines' memory estimate holds a pipeline's buffers too
        m + buffers[c - n_in] if c - n_in in buffers else m for c, m in enumerate(node_mem)
    )
    for i, (_, per_strategy) in conds.items():
        node_time[n_in + i] = np.array([b.seconds for b in per_strategy])
    node_time = tuple(node_time)
    edges = build_edges(graph, cost, strategies, source, share, combinable, after)
    for u, v, wait in waits:
        add_edge(edges, n_in + u, n_in + v, wait)
    aliases = find_aliases(graph)
    for o, i in aliases.items():
        v = graph.outputs[o]
        if v not in source or source[v][0] == i:
            continue
        u, k = source[v]
        t = graph.values[v]
        # The new value (producer u's output k) must come back in the arg's spec.
        mat = reshard_matrix(
            cost,
            t,
            tuple(s.out_specs[k] for s in strategies[u]),
            tuple(s.out_specs[0] for s in strategies[i]),
            cache,
            share=share if v in combinable else None,
        )
        add_edge(edges, u, i, mat)
    return Problem(
        graph,
        mesh,
        cost,
        tuple(strategies),
        source,
        aliases,
        tuple(dict.fromkeys(warnings)),
        flops,
        node_time,
        node_mem,
        edges,
        bodies,
        frozenset(partial_outputs),
        resident,
        conds,
        tuple(t - c for t, c in zip(node_time, node_comm)),
        share,
        waits=tuple((n_in + u, n_in + v, w) for u, v, w in waits),
        regions=tuple(f.members() for f in pipelined.fused) if pipelined is not None else (),
        buffers=buffers,
        loop_comm=loop_comm,
    )


def _scratch(body: Problem, result) -> float:
    """What a loop holds while it runs besides its inputs and results (which the
    outer walk counts): its body's peak under `result` less the body's arguments and
    its results (one step's carry, aliased to the loop's, and slices). A gradient
    accumulation loop's body is one micro-batch's forward and backward pass."""
    g = body.graph
    outs = 0
    for v in dict.fromkeys(g.outputs):
        u, k = body.source.get(v, (None, 0))
        if u is not None and u >= body.num_inputs:
            spec = body.strategies[u][result.choice[u]].out_specs[k]
            outs += body.cost.local_bytes(g.values[v], spec)
    return max(0.0, result.cost.peak_memory_bytes - result.cost.argument_bytes - outs)


def step_floor(
    graph: Graph, devices: int, profile, pipelined: PipelinedScans | None = None
) -> float:
    """A floor under every plan's predicted step for `graph` on `devices` devices: all
    of its FLOPs spread over every device at the profile's best FLOP rate, a pipelined
    loop's at the micro-batch size for all its slots (`Pipeline.ticks`: fill, drain). No
    op is priced below its FLOPs over its parallelism at its dtype's rate, and no
    communication below zero, so a search whose floor is above a price already found
    cannot beat it."""
    piped = pipelined.scans if pipelined is not None else {}
    deferred = (
        {f.backward for f in pipelined.fused}
        if pipelined is not None and pipelined.pipe.schedule == "zb-h1"
        else set()
    )
    total = 0.0
    each = graph.memo(flops_each)
    for node in graph.nodes:
        if node.id in piped:  # the body at the micro-batch size, in every slot
            pipe = pipelined.pipe
            micro = replace(node, body=piped[node.id][0])
            # `M + S - 1` slots of a stage's layers, or `M v + S - 1` of a chunk's
            total += pipe.ticks() / pipe.virtual * run_flops(micro, graph)
            if node.id in deferred:  # ZB-H1: no weight gradients in the ramp up's slots
                total += _deferral_flops(micro, pipe)
        else:
            total += each[node.id]
    return total / (max(profile.peak_flops.values()) * profile.compute_efficiency * devices)


def _deferral_flops(node, pipe) -> float:
    """`step_floor`'s share of what ZB-H1 changes in a backward loop's slots (as
    `piped._deferral_seconds` prices it): less `S - 1` weight-gradient passes, more
    the `M` passes' recomputation, over all the loop's layers."""
    p = node.params
    split = split_weight_grads(node.body, p["num_consts"], p["num_carry"])
    if split is None:
        return 0.0
    body, redo = node.body, set(split.recomputed)
    f = {j: node_flops(body.nodes[j], body) for j in split.w_nodes}
    again = sum(x for j, x in f.items() if j in redo)
    w_only = sum(f.values()) - again
    return p["length"] * (pipe.microbatches * again - (pipe.stages - 1) * w_only)


def batch_like_body_inputs(node) -> list[int]:
    """A loop's body inputs that are activations: those with the carry's leading
    (batch) dim, when the first carry has one; the others are weights and the like."""
    b = node.body
    n_fixed = node.params["num_consts"] + node.params["num_carry"]
    carry = [b.values[v] for v in b.inputs[n_fixed - node.params["num_carry"] : n_fixed]]
    if not carry or not carry[0].rank:
        return []
    return [i for i, v in enumerate(b.inputs) if b.values[v].shape[:1] == carry[0].shape[:1]]


def _node_costs(
    graph,
    mesh,
    cost,
    strategies,
    flops,
    carried=frozenset(),
    unsummed=frozenset(),
    resident=None,
    share=None,
):
    """Per cost-graph node and strategy: (seconds, bytes kept, seconds of the seconds
    that sum a returned Partial value, bucketed by `share` where it can be combined)."""
    n_in = len(graph.inputs)
    combinable = combinable_values(graph) if share is not None else frozenset()
    times, mems, comms = [], [], []
    in_types, out_types, kind = graph.memo(node_kinds)
    resident = resident or {}
    fractions = [(1.0,) for _ in graph.inputs] + [
        tuple(resident.get(v, 1.0) for v in n.outputs) for n in graph.nodes
    ]
    dtypes = [graph.values[v].dtype for v in graph.inputs] + [
        rate_dtype(n, graph, cost.profile) for n in graph.nodes
    ]
    pending = _output_partials(graph, strategies, n_in, carried, unsummed)
    outs = [tuple(graph.inputs[c : c + 1]) for c in range(n_in)] + [n.outputs for n in graph.nodes]
    traffic = graph.memo(hbm_traffic)
    memo: dict = {}  # repeated layers: identical ops cost the same
    for c, strats in enumerate(strategies):
        moved = traffic[c - n_in] if c >= n_in else None
        key = (
            id(strats),
            kind[c],  # its operand and result types, its HBM traffic, argument or op
            flops[c],
            tuple(pending.get(c, ())),
            dtypes[c],
            fractions[c],
            tuple(outs[c][k] in combinable for k in pending.get(c, ())),
        )
        if key not in memo:
            memo[key] = _strategy_costs(
                cost,
                strats,
                in_types[c],
                out_types[c],
                flops[c],
                pending.get(c, ()),
                c < n_in,
                moved,
                dtypes[c],
                fractions[c],
                tuple(share if outs[c][k] in combinable else None for k in pending.get(c, ())),
            )
        times.append(memo[key][0])
        mems.append(memo[key][1])
        comms.append(memo[key][2])
    return tuple(times), tuple(mems), tuple(comms)


def _strategy_costs(
    cost,
    strats,
    in_types,
    out_types,
    flops,
    pending,
    is_input,
    moved=None,
    dtype=np.float32,
    fractions=None,
    shares=None,
):
    t_arr = np.zeros(len(strats))
    m_arr = np.zeros(len(strats))
    c_arr = np.zeros(len(strats))
    reads, writes = moved or ((True,) * len(in_types), (True,) * len(out_types))
    for s_i, s in enumerate(strats):
        out_bytes = [cost.local_bytes(t, sp) for t, sp in zip(out_types, s.out_specs)]
        mem = sum(b * f for b, f in zip(out_bytes, fractions or (1.0,) * len(out_bytes)))
        m_arr[s_i] = mem
        if is_input:  # free; of equally fast plans `polish.lean_arguments` takes the leaner
            continue
        nbytes = sum(b for b, w in zip(out_bytes, writes) if w) + sum(
            cost.local_bytes(t, sp) for t, sp, r in zip(in_types, s.in_specs, reads) if r
        )
        t_arr[s_i] = cost.compute_seconds(flops / s.parallel, nbytes, dtype)
        # A partial value returned by the function must be summed before it leaves.
        for k, share in zip(pending, shares or (None,) * len(pending)):
            sp = s.out_specs[k]
            c_arr[s_i] += reshard_seconds(cost, out_types[k], sp, sp.without_partial(), share)
        t_arr[s_i] += c_arr[s_i]
    for a in (t_arr, m_arr, c_arr):
        a.setflags(write=False)
    return t_arr, m_arr, c_arr


def _output_partials(
    graph, strategies, n_in, carried=frozenset(), unsummed=frozenset()
) -> dict[int, list[int]]:
    """Per producer, its outputs the function returns (a Partial one is summed before it
    leaves), except state carried as a Partial sum (`carried` input positions) and the
    outputs returned unsummed (`unsummed` output positions)."""
    producer = graph.producer
    out: dict[int, list[int]] = {}
    kept = {graph.outputs[o] for o, i in find_aliases(graph).items() if i in carried}
    kept |= {graph.outputs[o] for o in unsummed}
    for v in dict.fromkeys(graph.outputs):
        if v in kept:
            continue
        if v in producer:
            node = graph.nodes[producer[v]]
            out.setdefault(n_in + node.id, []).append(node.outputs.index(v))
    return out
