"""Searches side by side in forked workers (`autopar.search.workers`): `auto`'s engines
and ZeRO retries, the mesh screen and pipeline tries give the plan searched inline;
errors and dead workers are handled, `time_limit=` honoured."""

import os
import re
import time
import warnings
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar import search
from autopar.compile import tries
from autopar.search import _NoClock, workers


def step(params, x):  # a train step: `auto` also ranks its ZeRO-3 candidate
    def loss(p):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"]) ** 2)

    g = jax.grad(loss)(params)
    return jax.tree_util.tree_map(lambda w, d: w - 0.1 * d, params, g)


def args():
    f = jnp.float32
    params = {
        "w1": jax.ShapeDtypeStruct((256, 512), f),
        "b1": jax.ShapeDtypeStruct((512,), f),
        "w2": jax.ShapeDtypeStruct((512, 256), f),
    }
    return params, jax.ShapeDtypeStruct((64, 256), f)


def plan(monkeypatch, n: int, **options):
    monkeypatch.setenv("AUTOPAR_WORKERS", str(n))
    monkeypatch.setattr(workers, "MIN_NODES", 0)  # this small problem is forked too
    monkeypatch.setattr(workers, "memory_cap", lambda: 64)  # whatever memory is free
    options = {"mesh": {"data": 4, "model": 2}, "engine": "auto", **options}
    return autopar.parallelize(step, progress=False, cache_dir=None, **options).plan(*args())


def test_side_by_side_finds_the_plan_searched_inline(monkeypatch):
    inline = plan(monkeypatch, 1)
    side = plan(monkeypatch, 2)
    assert "dp" in inline.phases and "engines" not in inline.phases
    assert "engines" in side.phases and "dp" not in side.phases  # searched in the children
    assert side.to_json() == inline.to_json()  # the same plan, candidates and solver info
    # what the workers spent is reported beside the parent's phases, not added to them
    assert inline.worker_phases is None and side.worker_phases["dp"] > 0
    assert "side by side, in the workers (overlapping): " in side.summary()
    from test_cli import SCHEMA, check_schema

    assert check_schema(side.to_json(timings=True), SCHEMA) == []
    assert set(side.candidates) >= {"recursive", "dp", "data", search.AUTO_ZERO3}


def test_a_workers_error_is_raised_in_the_caller(monkeypatch):
    def broken(problem, pins, info):
        raise ZeroDivisionError("inside the dp engine")

    monkeypatch.setitem(search.ENGINES, "dp", broken)
    with pytest.raises(ZeroDivisionError, match="inside the dp engine"):
        plan(monkeypatch, 2)


def test_a_dead_worker_is_named_and_its_search_run_here(monkeypatch):
    dp = search.ENGINES["dp"]

    def dies(problem, pins, info):
        if workers._IN_CHILD:
            os._exit(3)
        return dp(problem, pins, info)

    monkeypatch.setitem(search.ENGINES, "dp", dies)
    with pytest.warns(
        RuntimeWarning, match=r"worker for dp ended without a result \(exit code 3\)"
    ):
        p = plan(monkeypatch, 2)
    monkeypatch.setitem(search.ENGINES, "dp", dp)
    assert p.to_json() == plan(monkeypatch, 1).to_json()


def test_time_limit_stops_the_workers_still_searching(monkeypatch):
    dp = search.ENGINES["dp"]

    def slow(problem, pins, info):
        time.sleep(30)
        return dp(problem, pins, info)

    monkeypatch.setitem(search.ENGINES, "dp", slow)
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(monkeypatch, 4, time_limit=3.0)
    assert time.perf_counter() - t < 20
    said = " ".join(str(w.message) for w in caught)
    assert "dp (stopped at the time limit)" in said, said
    assert "dp" not in p.candidates and "recursive" in p.candidates


def test_workers_setting_is_read_and_checked(monkeypatch):
    monkeypatch.setenv("AUTOPAR_WORKERS", "3")
    monkeypatch.setattr(workers, "memory_cap", lambda: 64)
    assert workers.count() == 3
    assert workers.usable(10**6, 2) == 2 and workers.usable(10**6, 1) == 1
    assert workers.usable(workers.MIN_NODES - 1, 4) == 1
    monkeypatch.setattr(workers, "memory_cap", lambda: 1)  # memory for one child only
    assert workers.usable(10**6, 4) == 1
    monkeypatch.undo()
    assert workers.memory_cap() >= 1
    monkeypatch.delenv("AUTOPAR_WORKERS", raising=False)
    monkeypatch.setattr(workers.sys, "platform", "darwin")  # inline unless asked
    assert workers.count() == 1
    monkeypatch.setenv("AUTOPAR_WORKERS", "many")
    with pytest.raises(ValueError, match="AUTOPAR_WORKERS='many'"):
        workers.count()


def test_mesh_shapes_are_screened_side_by_side_to_the_same_plan(monkeypatch):
    inline = plan(monkeypatch, 1, mesh=8)
    phases, run_all = [], workers.run_all

    def counted(tasks, n, clock, **kw):
        phases.append((kw.get("phase", "engines"), len(tasks), kw.get("beside") is not None))
        got = run_all(tasks, n, clock, **kw)
        shapes.append({key[0] if isinstance(key, tuple) else key for key in got})
        return got

    shapes: list[set] = []
    monkeypatch.setattr(workers, "run_all", counted)
    side = plan(monkeypatch, 2, mesh=8)
    # the screen: one worker screens its list while this process screens its own
    assert phases[0] == ("screen", 1, True), phases
    # the 3 shapes within the screen's margin: all their engines in one pool, started
    # with the 4 of the shape this process screened (its problem kept), the others'
    # after this process built their problems beside the workers (`tries.firsts_ahead`)
    assert phases[1] == ("engines", 4, True) and len(phases) == 2, phases
    assert len(shapes[1]) == 3, shapes
    assert "screen" in inline.phases and "screen" in side.phases
    assert side.to_json() == inline.to_json()
    assert [w for w in side.warnings if "mesh shapes" in w] == [
        w for w in inline.warnings if "mesh shapes" in w
    ]


def test_zero_retries_of_plans_over_budget_run_side_by_side_to_the_same_plan(monkeypatch):
    roomy = plan(monkeypatch, 1)
    budget = 0.98 * roomy.cost.peak_memory_bytes  # the ZeRO retries are searched
    inline = plan(monkeypatch, 1, memory_budget=budget)
    batches, run_all = [], workers.run_all

    def counted(tasks, n, clock, **kw):
        batches.append(sorted(tasks))
        return run_all(tasks, n, clock, **kw)

    monkeypatch.setattr(workers, "run_all", counted)
    side = plan(monkeypatch, 2, memory_budget=budget)
    # (plain SGD: no optimizer state, so no ZeRO-1; recursive+zero3 ran in the first
    # batch, with the plan of the mesh's axes merged, `compile.merged`)
    assert "dp+zero3" in inline.candidates, inline.candidates
    first = ["data", "dp", "dp@data*model", "recursive", "recursive+zero3"]
    assert batches == [first, ["dp+zero3"]], batches
    assert side.to_json() == inline.to_json()


@pytest.mark.parametrize(
    "scan, min_nodes",
    [(True, 10**6), (True, 10), pytest.param(False, 10**6, marks=pytest.mark.slow)],
)
def test_pipeline_tries_side_by_side_find_the_plan_searched_inline(monkeypatch, scan, min_nodes):
    """`pipeline_stages="auto"`: every (stage count, micro-batch count) try searched in
    a child, layers under `scan` or unrolled in Python (rolled); the plan, its notes on
    the tries, and the tries left out by their floors are those of the inline walk.
    Pipelined tries go side by side even where each try's graph is big enough for its
    engines to (`min_nodes` 10): building a try searches its loop bodies, which
    engines side by side would leave to the planner alone."""
    from autopar.examples.models import gpt

    cfg = gpt.GPTConfig(hidden=64, heads=4, seq=32, vocab=256, layers=4, batch_size=8)
    ts = gpt.make_train_step(replace(cfg, scan_layers=scan))
    abstract = (jax.eval_shape(ts.init, 0), jax.eval_shape(ts.batch, 0))

    def planned(n):
        monkeypatch.setenv("AUTOPAR_WORKERS", str(n))
        # the tries side by side (their engines inline in each child)
        monkeypatch.setattr(workers, "MIN_NODES", min_nodes)
        monkeypatch.setattr(workers, "memory_cap", lambda: 64)
        monkeypatch.setattr(tries, "size", lambda graph: 10**7)
        par = autopar.parallelize(
            ts.step, mesh=16, cluster="a100-80g", pipeline_stages="auto", progress=False
        )
        return par.plan(*abstract)

    inline, side = planned(1), planned(2)
    assert "tries" in side.phases and "tries" not in inline.phases
    assert side.to_json() == inline.to_json()


def test_a_try_is_left_out_ahead_only_where_the_walk_leaves_it_out(monkeypatch):
    """`compile.tries.ahead` skips a try at its turn only by the walk replayed over the
    results in: here try 1's screen price is past the margin of try 0's price (the walk
    drops it) yet its own search is the cheapest; try 2 must still be searched, though
    2 x try 1's price is below its screen price."""
    from types import SimpleNamespace

    from autopar.search.result import SearchResult

    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    monkeypatch.setattr(workers, "MIN_NODES", 10**6)  # engines inline, tries side by side
    monkeypatch.setattr(workers, "memory_cap", lambda: 64)
    monkeypatch.setattr(tries, "size", lambda graph: 10**7)
    screen, price = {0: 1.0, 1: 10.0, 2: 3.0}, {0: 4.0, 1: 1.0, 2: 5.0}

    def one(step, i):
        time.sleep(1.0 if i == 0 else 0.0)  # try 1 finishes while try 0 still searches
        cost = SimpleNamespace(step_s=price[i])
        return None, SearchResult((), "dp", cost, 0.0, {}, (("dp", (), cost),))

    def pruned(i, best):  # the walk's screen-margin rule
        return screen[i] > 2.0 * best

    mesh = SimpleNamespace(axis_names=("data",), axis_sizes=(8,))
    graph = SimpleNamespace(nodes=[])
    got = tries.ahead(graph, [(0, mesh, None)] * 3, [0, 1, 2], one, pruned, _NoClock())
    assert sorted(got) == [0, 1, 2]  # the walk searches 0 and 2 (best 4: 3 <= 2 x 4)


def test_the_screen_keeps_the_costliest_shapes_here_and_balances_the_rest():
    """This process screens the costliest shape (its problem is kept for the full
    search, a worker's is built again) and the lists are balanced by work (4x per mesh
    axis); each list keeps the tries' order."""
    from types import SimpleNamespace

    from autopar.compile.screen import _shares

    shapes = [{"d": 32, "m": 8}, {"d": 32, "m": 2, "e": 4}, {"d": 256}, {"d": 64, "m": 4}]
    shapes += [{"d": 64, "m": 2, "e": 2}, {"d": 2, "m": 128}, {"d": 4, "m": 64}]
    infos = {i: SimpleNamespace(shape=s) for i, s in enumerate(shapes)}
    mine, theirs = _shares(infos, 2)
    assert mine == [0, 1, 2, 5] and theirs == [[3, 4, 6]]  # 16+64+4+16 against 16+64+16
    mine, theirs = _shares(infos, 3)
    assert mine[0] == 1 and sorted(mine + sum(theirs, [])) == list(range(7))
    assert all(lst == sorted(lst) for lst in theirs)


def test_time_limit_cuts_the_screen_side_by_side_and_names_what_it_left(monkeypatch):
    """`mesh=N` with the screen shared between this process and a worker: past the
    time limit each screens no more shapes than the one it started with, names the
    rest, and a plan still comes back."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(monkeypatch, 2, mesh=8, time_limit=1e-3)
    said = " ".join(str(w.message) for w in caught)
    assert "time_limit=0.001 s reached" in said
    # 4 shapes, two of them one mesh to the cost model (data 4 x model 2 relabeled):
    # one screened by each process, the third named
    left = re.findall(r"the screen and search of (\d) of 4 mesh/pipeline tries", said)
    assert sum(map(int, left)) == 1, said
    assert p.cost.step_s > 0


def test_the_engines_of_the_screened_shapes_are_left_out_only_where_the_walk_leaves_them(
    monkeypatch,
):
    """`compile.tries.firsts_ahead`: the first searches of the shapes within the screen's
    margin, in one pool. A shape's tasks are skipped at their turn only by the walk
    replayed over the shapes whose tasks are all in: shape 1's screen price is past the
    margin of shape 0's price, so it is skipped, though its own plan would have been
    the cheapest; shape 2 is still searched. Shapes missing from `built` are built
    here, beside the workers, and their tasks run after."""
    from types import SimpleNamespace

    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    monkeypatch.setattr(workers, "memory_cap", lambda: 64)
    run_all = workers.run_all  # one task at a time, in order: the replay is deterministic
    monkeypatch.setattr(workers, "run_all", lambda tasks, n, *a, **kw: run_all(tasks, 1, *a, **kw))
    screen, price = {0: 4.0, 1: 7.0, 2: 6.0, 3: 50.0}, {0: 3.0, 1: 1.0, 2: 5.0, 3: 0.5}
    built = {0: 0}

    def tasks_of(i):
        cost = SimpleNamespace(step_s=price[i], peak_memory_bytes=0)
        return {"dp": lambda: (([i], cost), {}), "recursive": lambda: (([i], cost), {})}

    def pruned(i, best):  # the walk's screen-margin rule
        return screen[i] > 2.0 * best

    got = tries.firsts_ahead(
        [0, 1, 2, 3], screen, built, pruned, 1.0, _NoClock(), 10**6,
        build=lambda i: i, tasks_of=tasks_of, name=str,
    )  # fmt: skip
    # 1 and 2 built beside the first worker; 3 is past the margin of the best screen
    # price (50 > 2 x 4), so not in the pool
    assert sorted(built) == [0, 1, 2]
    assert sorted(got) == [0, 2]  # the walk searches 0 and 2 (best 3: 7 > 2 x 3 >= 6)
    assert sorted(got[2]) == ["dp", "recursive"] and got[2]["dp"][0][1].step_s == 5.0
