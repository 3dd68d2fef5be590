"""The search's compiled loops (`autopar/search/solvers/kernels.py`) against the plain
Python they replaced, kept here as references: D-Rec's passes and `refine` give the
same plan to the last strategy on real problems (a GPT step on 1-, 2- and 3-axis
meshes, with pins), as `forest_descent` and `minplus` do in `test_solvers.py`."""

from __future__ import annotations

import platform
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.search import engines


def _refine_reference(problem, choice, pinned, sweeps):
    """`engines.refine` as Python: each free node, in order, to its cheapest strategy
    given all its neighbours, when cheaper by more than 1e-15."""
    nb = engines.neighbour_tables(problem)
    every = np.ones(len(choice), bool)
    for _ in range(sweeps):
        changed = False
        for v in range(len(choice)):
            if v in pinned or len(problem.strategies[v]) == 1:
                continue
            size = len(problem.strategies[v])
            score = problem.node_time[v] + engines.edge_sum(nb[v], choice, every, size)
            best = int(np.argmin(score))
            if score[best] < score[choice[v]] - 1e-15:
                choice[v], changed = best, True
        if not changed:
            break
    return choice


def _drec_reference(problem, pinned):
    """D-Rec's passes of `engines._recursive` (before its final `refine`) as Python."""
    g, n_in, mesh = problem.graph, problem.num_inputs, problem.mesh
    n = len(problem.strategies)
    nb = engines.neighbour_tables(problem)
    axes = [mesh.axis_names.index(a) for a in engines.axis_order_slow_first(mesh)]
    none = tuple([None] * len(mesh.axis_names))
    lookup = [{s.assignment: i for i, s in enumerate(st)} for st in problem.strategies]
    choice = [lookup[v].get(none, 0) for v in range(n)]
    for v, s in pinned.items():
        choice[v] = s
    fixed = [v in pinned or len(problem.strategies[v]) == 1 for v in range(n)]
    heavy = [not fixed[v] and v >= n_in and g.nodes[v - n_in].op in engines._TIER for v in range(n)]
    small = engines._latency_bound(problem)
    order = sorted(
        (v for v in range(n) if heavy[v]),
        key=lambda v: (small[v], engines._TIER[g.nodes[v - n_in].op], -problem.flops[v], v),
    )
    margin = engines._least_latency(problem)
    table = engines._replication_penalty(problem)  # [axis, strategy] per op
    tables: dict[int, np.ndarray] = {}

    def penalty(v, i, ai):
        if v < n_in:
            return 0.0
        if v not in tables:
            tables[v] = table(v)
        return tables[v][ai, i]

    def candidates(v, ai):
        strats = problem.strategies[v]
        base = strats[choice[v]].assignment
        got = [
            i
            for i, s in enumerate(strats)
            if all(s.assignment[a] == base[a] for a in range(len(base)) if a != ai)
        ]
        whole = [i for i in got if strats[i].assignment[ai : ai + 1] in ((), (None,))]
        return got, (whole or got) if small[v] else got

    def decide(v, ai, decided, defer=False):
        edge = engines.edge_sum(nb[v], choice, decided, len(problem.strategies[v]))
        times = problem.node_time[v]

        def cheapest(cands):
            scores = [times[i] + penalty(v, i, ai) + edge[i] for i in cands]
            k = int(np.argmin(scores))
            return cands[k], scores[k]

        every, kept = candidates(v, ai)
        best, low = cheapest(kept)
        if small[v]:  # a small op takes a cut only where it spares a collective
            other, score = cheapest(every)
            if score < low - margin:
                best = other
            elif defer and other != best and score < low + margin:
                return False  # its decided neighbours do not settle it
        choice[v] = best
        decided[v] = True
        return True

    def flood(queue, ai, decided):
        while queue:
            u = queue.popleft()
            for w, _ in nb[u]:
                if not decided[w] and not heavy[w] and decide(w, ai, decided, True):
                    queue.append(w)

    for ai in axes:
        decided = np.array(fixed)
        for v in order:
            if not decided[v]:
                decide(v, ai, decided)
            flood(deque([v]), ai, decided)
        flood(deque(v for v in range(n) if decided[v]), ai, decided)
        for v in range(n):
            if not decided[v]:
                decide(v, ai, decided)
                flood(deque([v]), ai, decided)
    return choice


def _gpt_problem(mesh: dict[str, int]):
    """A 2-layer GPT-style train step (embedding, attention, MLP, SGD) on `mesh`."""
    import cost_models
    from autopar.cost.model import CostModel
    from autopar.ir.capture import capture
    from autopar.search.problem import build_problem
    from autopar.sharding import MeshInfo

    d, seq, batch, vocab = 512, 128, 16, 1024
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    params = {
        "wte": jax.random.normal(keys[0], (vocab, d)) * 0.02,
        "layers": [
            {
                "qkv": jax.random.normal(keys[1 + i], (d, 3 * d)) * 0.02,
                "up": jax.random.normal(keys[3 + i], (d, 4 * d)) * 0.02,
                "down": jax.random.normal(keys[5 + i], (4 * d, d)) * 0.02,
            }
            for i in range(2)
        ],
    }
    tokens = (jnp.arange(batch * seq).reshape(batch, seq) * 7) % vocab

    def loss(p, t):
        x = p["wte"][t]
        for layer in p["layers"]:
            q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
            att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 8.0, axis=-1)
            x = x + jnp.einsum("bqk,bkd->bqd", att, v)
            x = x + jax.nn.gelu(x @ layer["up"]) @ layer["down"]
        logits = x @ p["wte"].T
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    def step(p, t):
        grads = jax.grad(loss)(p, t)
        return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, grads)

    profile = cost_models.load("h100-sxm")
    info = MeshInfo.build(tuple(mesh), tuple(mesh.values()), None, profile.devices_per_node)
    return build_problem(capture(step, (params, tokens)), info, CostModel(profile, info))


@pytest.mark.parametrize(
    "mesh", [{"data": 8}, {"data": 2, "model": 4}, {"data": 2, "model": 2, "expert": 2}]
)
def test_compiled_drec_and_refine_are_the_python_loops(mesh):
    """D-Rec's compiled passes, then `refine`, give exactly the plan of the Python
    loops, free and with pins (the embedding and a weight pinned to their last
    strategies); the passes split most ops (tensors large enough to be worth a cut),
    so their order of decisions shows; `refine` from a random plan too."""
    problem = _gpt_problem(mesh)
    for pinned in ({}, {0: len(problem.strategies[0]) - 1, 2: len(problem.strategies[2]) - 1}):
        passes = _drec_reference(problem, pinned)
        assert engines._drec_passes(problem, pinned) == passes
        assert sum(problem.strategies[v][s].parallel > 1 for v, s in enumerate(passes)) > 50
        got = engines._recursive(problem, pinned, 8)
        assert got == _refine_reference(problem, passes, pinned, 8)
        rng = np.random.default_rng(len(mesh))
        start = [int(rng.integers(0, len(st))) for st in problem.strategies]
        for v, s in pinned.items():
            start[v] = s
        assert engines.refine(problem, list(start), pinned, 3) == _refine_reference(
            problem, list(start), pinned, 3
        )


def test_flat_graph_stores_equal_matrices_once_and_reads_every_entry_both_ways():
    """Edges whose matrices are equal in value (distinct objects, or a transposed view)
    share one stored copy per direction, and every directed edge reads entry [i, j] of
    its own orientation: a mistake in the offsets or the row width shows as a wrong
    entry here."""
    from autopar.search.solvers.kernels import flat_graph

    rng = np.random.default_rng(0)
    a = rng.random((3, 5))
    b = rng.random((5, 4))
    cost = [rng.random(3), rng.random(5), rng.random(3), rng.random(5), rng.random(4)]
    edges = {(0, 1): a, (2, 3): a.copy(), (1, 4): b, (3, 4): np.ascontiguousarray(b.T).T}
    g = flat_graph(cost, edges)
    assert g.flat.size == 2 * (a.size + b.size)  # each value once, both ways
    for k, ((u, v), m) in enumerate(edges.items()):
        for d, (x, y, want) in enumerate([(u, v, m), (v, u, m.T)]):
            at = g.at[2 * k + d]
            got = g.flat[at : at + want.size].reshape(g.size[x], g.size[y])
            np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 machine code")
def test_min_plus_loops_store_every_lane():
    """The running minima of the min-plus loops (`minplus`, a forest round's folds) are
    written as `np.minimum`, which LLVM vectorizes as compare-and-blend; a select or a
    branch there vectorizes with masked stores (`vmaskmov`), microcoded on AMD Zen,
    where they made those loops ~4x slower (`solvers._compiled`, `_MIN`). Compiled
    afresh here: numba cannot show the machine code of a cached function."""
    import numba

    from autopar.search.solvers import _compiled, kernels

    minplus = numba.njit(_compiled.minplus.py_func)
    a = np.ones((4, 3), np.float32)
    minplus(a, a.T.copy(), np.empty((4, 4), np.float32))
    g = kernels.flat_graph([np.zeros(2), np.zeros(2)], {(0, 1): np.eye(2)})
    fold = numba.njit(_compiled.round_forest.py_func)
    c = np.zeros(2, np.int64)
    fold(np.arange(2), c, c.copy(), g.adj_ptr, g.adj, g.dst, g.at, g.flat, g.cost, g.size)
    for f in (minplus, fold):
        (asm,) = f.inspect_asm().values()
        assert "vmaskmov" not in asm, f.py_func.__name__
