"""What the `data` and `fsdp` recipes search: the problem with a penalty on gathering a
split value (`data_problem`, `zero3_problem`), and data parallelism as it runs as their
descent's start (`batch_wave`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from autopar.cost.tables import reshard_table
from autopar.search.build import Problem
from autopar.search.engines import propagate
from autopar.search.layouts import batch_like_inputs

# What `data` adds to a resharding that gathers or moves a split value: data parallelism
# communicates only sums (the gradients' all-reduce), so it gathers nothing it can avoid.
DATA_GATHER_PENALTY = 1.0  # seconds, far above any step's price


def batch_wave(problem: Problem, pinned: Mapping[int, int]) -> list[int]:
    """Data parallelism built the way it runs: propagation from the pinned batch-like
    inputs alone, so the batch split reaches every op before the parameters' replicated
    pins do (propagating from all pins at once decides a weight's consumers from the
    weight first: replicated). A start for the recipes' `dp` solve, whose local search
    from its own guess can keep a region gathered: MobileNet's `data` plan gathered the
    pooled features and labels to run the classifier head replicated."""
    batch = batch_like_inputs(problem)
    seeds = {v for v in pinned if v < problem.num_inputs and batch[v]}
    return propagate(problem, pinned, seeds or None, forward=bool(seeds))


# ops that only cast or re-view a value: a parameter reaches its uses through them
_VIEWS = frozenset(
    {"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze", "copy"}
)


def parameter_values(problem: Problem) -> frozenset[int]:
    """The arguments that are not batch-like (parameters, optimizer state) and the values
    made from them by casts and re-views alone: what ZeRO-3 gathers before each use."""
    g = problem.graph
    batch = batch_like_inputs(problem)
    out = {v for v, b in zip(g.inputs, batch) if not b}
    for node in g.nodes:
        if node.op in _VIEWS and node.inputs and node.inputs[0] in out:
            out.update(node.outputs)
    return frozenset(out)


def zero3_problem(problem: Problem) -> Problem:
    """What `fsdp` searches (with `fsdp_pins`): ZeRO-3, parameters and optimizer state
    sharded over every device and gathered where they are used, everything else data
    parallel: `data_problem`'s penalty on gathering or moving a split value, except the
    parameters (`parameter_values`)."""
    return data_problem(problem, exempt=parameter_values(problem))


def data_problem(problem: Problem, exempt: frozenset[int] = frozenset()) -> Problem:
    """`problem` with `DATA_GATHER_PENALTY` on every edge entry whose reshard gathers or
    moves a split value (other than the values in `exempt`): what the `data` engine
    searches (with `data_pins`). Completing `data_pins` by the cheapest plan would, on a
    model-parallel-shaped layer (hidden >> batch), gather the batch and compute
    replicated (or split the weights); with the penalty each op keeps the batch split
    where any strategy can, and partial gradients are summed (all-reduce). Nodes and
    strategies are `problem`'s, so a choice made on it is priced on `problem`."""
    from dataclasses import replace

    g, n_in, cost = problem.graph, problem.num_inputs, problem.cost
    edges = dict(problem.edges)
    tables: dict = {}  # (type, producer table, output, consumer table, operand) -> penalty
    memo: dict = {}  # `reshard_table`'s
    # edge matrix + penalty -> their sum, made once: edges that share a matrix (repeated
    # layers) share the sum too, rather than a copy per edge (12302 copies, 834 MB, on
    # the 7B step's 3-axis graph, which `solvers.kernels.flat_graph` then had to copy
    # again, or now hash, to store once)
    sums: dict = {}

    for node in g.nodes:
        v = n_in + node.id
        for j, x in enumerate(node.inputs):
            if x not in problem.source or x in exempt:
                continue
            u, k = problem.source[x]
            t = g.values[x]
            # repeated layers share strategy tables (as in `search.edges.build_edges`)
            key = (t, id(problem.strategies[u]), k, id(problem.strategies[v]), j)
            if key not in tables:
                src = tuple(s.out_specs[k] for s in problem.strategies[u])
                dst = tuple(s.in_specs[j] for s in problem.strategies[v])
                moves = reshard_table(cost, src, dst, memo).gathers(t.nbytes)
                tables[key] = np.where(moves, DATA_GATHER_PENALTY, 0.0).reshape(len(src), len(dst))
            extra = tables[key]
            if not extra.any():
                continue
            key, flip = ((u, v), False) if u < v else ((v, u), True)
            held = edges.get(key)
            add = (id(held), id(extra), flip)
            if add not in sums:
                mat = extra.T if flip else extra
                sums[add] = (held, extra, mat if held is None else held + mat)
            edges[key] = sums[add][2]
    return replace(problem, edges=edges)
