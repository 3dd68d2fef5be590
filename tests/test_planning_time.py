"""Planning time: the plan cache on disk, the progress display, `time_limit=`, the phase
timings in the plan, and the incremental pricing of the latency polish."""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.compile.cache import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def mlp(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def mlp_relu(params, x):  # the same types, another program
    h = jax.nn.relu(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def args(batch=64):
    f = jnp.float32
    params = {
        "w1": jax.ShapeDtypeStruct((256, 512), f),
        "w2": jax.ShapeDtypeStruct((512, 256), f),
    }
    return params, jax.ShapeDtypeStruct((batch, 256), f)


def plan(tmp_path, fn=mlp, batch=64, **options):
    options = {"mesh": {"data": 4, "model": 2}, "engine": "dp", **options}
    step = autopar.parallelize(fn, cache_dir=tmp_path, progress=False, **options)
    return step.plan(*args(batch))


def _run(code: str, env=None, timeout=600) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AUTOPAR_")}
    env = {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


# ---- the plan cache -------------------------------------------------------------------------


def test_cache_is_off_by_default(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOPAR_CACHE_DIR", raising=False)
    assert cache_dir(None) is None and cache_dir(False) is None
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    assert cache_dir(None) == tmp_path and cache_dir(False) is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir(True) == tmp_path / "xdg" / "autopar"
    step = autopar.parallelize(mlp, mesh={"data": 8}, cache_dir=False, progress=False)
    assert step.plan(*args()).cache is None


def test_cache_hit_in_a_fresh_process_is_fast(tmp_path):
    """The second process reads the stored plan by the trace-free key: a hit, well under
    a second (no trace), the same plan; calling the function then traces and binds the
    same entry by the traced key."""
    code = f"""
        import time, json, sys
        import autopar
        from autopar import examples
        import jax
        w = examples.gpt_small()
        t = time.perf_counter()
        jax.make_jaxpr(w.fn)(*w.args)
        trace = time.perf_counter() - t
        jax.clear_caches()
        step = autopar.parallelize(w.fn, mesh={{"data": 2, "model": 4}},
                                   donate_argnums=w.donate_argnums, cache_dir={str(tmp_path)!r})
        t = time.perf_counter()
        p = step.plan(*w.args)
        dt = time.perf_counter() - t
        traced = step.lower(*w.args) and step._cache  # the call path: traced, bound
        (c,) = traced.values()
        print(json.dumps({{"s": dt, "trace": trace, "cache": p.cache, "phases": p.phases,
                          "plan": p.to_json(), "call_cache": c.plan.cache,
                          "call_plan": c.plan.to_json()}}))
    """

    def parts(path):
        return pickle.loads(Path(path).read_bytes())["cache_parts"]

    for _ in range(3):  # again when autopar's own files changed in between (a shared tree)
        first = _run(code)
        assert first.returncode == 0, first.stderr
        a = json.loads(first.stdout.splitlines()[-1])
        assert a["cache"]["status"] in ("stored", "hit")
        second = _run(code)
        assert second.returncode == 0, second.stderr
        b = json.loads(second.stdout.splitlines()[-1])
        if b["cache"]["status"] == "hit" or a["cache"]["status"] == "hit":
            break
        pa, pb = parts(a["cache"]["path"]), parts(b["cache"]["path"])
        assert {k for k in pa if pa[k] != pb[k]} == {"code"}, (pa, pb)
    assert b["cache"]["status"] == "hit" and b["cache"]["key"] == "source", b["cache"]
    assert b["plan"] == a["plan"] == b["call_plan"]
    assert set(b["phases"]) == {"cache", "other", "total"}  # nothing traced or searched
    assert b["call_cache"]["status"] == "hit" and "key" not in b["call_cache"]
    print(f"search {a['s']:.2f} s, cached {b['s']:.3f} s, make_jaxpr {b['trace']:.3f} s")
    assert b["s"] < 1.0, (b["s"], b["phases"])


SOURCE = """
import jax.numpy as jnp

SCALE = {scale}


def helper(h):
    return jnp.{act}(h) * SCALE


def mlp(params, x):
    h = helper(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)
"""


def _module(tmp_path, name, **kw):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(SOURCE.format(**{"scale": 1.0, "act": "tanh", **kw}))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_trace_free_key_misses_on_any_change_it_can_see(tmp_path):
    """`.plan()` answers from the trace-free key only for the same code, closure values,
    globals, shapes, mesh and options; an edit of the function's file, a changed global,
    a changed closure value or a changed shape is a miss (searched, or bound by the
    traced key: never the source key's answer)."""
    cache = tmp_path / "cache"
    run = lambda fn, batch=64, **o: plan(cache, fn=fn, batch=batch, **o)  # noqa: E731
    base = _module(tmp_path, "user_a")
    assert run(base.mlp).cache["status"] == "stored"
    assert run(base.mlp).cache.get("key") == "source"
    edited = _module(tmp_path, "user_c", act="sin")  # the helper's file changed
    assert run(edited.mlp).cache["status"] == "stored"
    base.SCALE = 2.0  # a global the helper reads
    assert run(base.mlp).cache.get("key") is None
    base.SCALE = 1.0
    assert run(base.mlp, batch=128).cache["status"] == "stored"
    assert run(base.mlp, engine="recursive").cache["status"] == "stored"

    def closure(k):
        def step(params, x):
            return jnp.mean((jnp.tanh(x @ params["w1"]) * k @ params["w2"]) ** 2)

        return step

    assert run(closure(1.0)).cache["status"] == "stored"
    assert run(closure(1.0)).cache.get("key") == "source"
    assert run(closure(3.0)).cache.get("key") is None


def test_a_call_never_runs_a_plan_the_trace_free_key_got_wrong(tmp_path, monkeypatch):
    """What the fingerprint cannot see (here an environment variable read while tracing)
    can make `.plan()` answer with the old program's plan; a call traces, misses the
    traced key, searches, runs the right program, and repoints the source key."""
    import numpy as np

    def step(params, x):
        act = jnp.tanh if os.environ.get("ACT", "tanh") == "tanh" else jax.nn.relu
        return jnp.mean((act(x @ params["w1"]) @ params["w2"]) ** 2)

    make = lambda: autopar.parallelize(  # noqa: E731
        step, mesh={"data": 4, "model": 2}, engine="dp", cache_dir=tmp_path, progress=False
    )
    p0 = make().plan(*args())
    assert p0.cache["status"] == "stored"
    monkeypatch.setenv("ACT", "relu")
    assert make().plan(*args()).cache.get("key") == "source"  # the documented blind spot
    shapes = args()
    real = [
        jnp.linspace(-1, 1, int(np.prod(s.shape)), dtype=s.dtype).reshape(s.shape)
        for s in jax.tree.leaves(shapes)
    ]
    params, x = jax.tree.unflatten(jax.tree.structure(shapes), real)
    fresh = make()
    np.testing.assert_allclose(fresh(params, x), jax.jit(step)(params, x), rtol=1e-5)
    (compiled,) = fresh._cache.values()
    assert compiled.plan.cache["status"] == "stored"  # searched for the relu program
    again = make().plan(*args())
    assert again.cache.get("key") == "source" and again.cache["path"] == compiled.plan.cache["path"]


def test_cache_hit_and_misses(tmp_path):
    """Same call in a new `parallelize`: a hit. A change of program, shape, mesh, profile
    or option: a miss, a new entry, and a plan of its own."""
    base = plan(tmp_path)
    assert base.cache["status"] == "stored"
    again = plan(tmp_path)
    assert again.cache["status"] == "hit"
    assert again.to_json() == base.to_json()
    changes = {
        "program": dict(fn=mlp_relu),
        "shape": dict(batch=128),
        "mesh": dict(mesh={"data": 2, "model": 4}),
        "profile": dict(cluster="a100-80g"),
        "option": dict(engine="recursive"),
        "budget": dict(memory_budget=40e9),
    }
    for what, change in changes.items():
        p = plan(tmp_path, **change)
        assert p.cache["status"] == "stored", what  # searched, not taken from the cache
    files = list(tmp_path.glob("*.pkl"))
    assert len(files) == 1 + len(changes)
    shape = plan(tmp_path, batch=128)
    assert shape.cache["status"] == "hit" and shape.inputs[-1].shape == (128, 256)


def test_a_broken_cache_entry_is_a_miss(tmp_path):
    plan(tmp_path)
    (entry,) = tmp_path.glob("*.pkl")
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = plan(tmp_path)
    assert p.cache["status"] == "stored"
    assert pickle.loads(entry.read_bytes())["plan"].to_json() == p.to_json()


# ---- progress --------------------------------------------------------------------------------


PROGRESS = """
    import autopar
    from autopar import examples
    w = examples.gpt_small()
    step = autopar.parallelize(w.fn, mesh=8, donate_argnums=w.donate_argnums)
    p = step.plan(*w.args)
    print("phases", p.phases)
"""


def test_a_long_search_shows_progress_on_stderr():
    """From the Python API, with no logging configured: lines on stderr (not a terminal)
    naming the phase, the mesh try k of n and the elapsed time; none with
    AUTOPAR_PROGRESS=0."""
    r = _run(PROGRESS)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("autopar [")]
    assert lines, r.stderr
    assert any("searching with" in ln for ln in lines), r.stderr
    assert any("/" in ln.split("]")[1] for ln in lines), r.stderr  # [k/n] of the mesh tries
    assert "autopar: planned in" in r.stderr
    quiet = _run(PROGRESS, env={"AUTOPAR_PROGRESS": "0"})
    assert quiet.returncode == 0, quiet.stderr
    assert "autopar [" not in quiet.stderr and "planned in" not in quiet.stderr


def test_progress_keeps_the_users_log_records(caplog):
    """While the display is open, records the user's handlers would see still reach them."""
    import logging

    from autopar.compile.progress import Progress

    with caplog.at_level(logging.WARNING, logger="autopar"), Progress(show_after=60):
        logging.getLogger("autopar").info("a phase")
        logging.getLogger("autopar").warning("a warning")
    assert [r.getMessage() for r in caplog.records] == ["a warning"]


def test_after_the_display_closes_info_records_stay_quiet():
    """The display raises the `autopar` logger to INFO while open and puts its level back
    through `setLevel`, which clears logging's level cache: set back by assignment, the
    cached `isEnabledFor(INFO)` stayed true and a later plan without the display printed
    its phases through the user's handlers."""
    import logging

    from autopar.compile.progress import Progress

    log, root, seen = logging.getLogger("autopar"), logging.getLogger(), []
    handler = logging.Handler()  # the user's, as `logging.basicConfig` adds it
    handler.emit = lambda record: seen.append(record.getMessage())
    level = log.level
    log.setLevel(logging.WARNING)
    root.addHandler(handler)
    try:
        with Progress(show_after=60):
            log.info("a phase")  # the display's
        log.info("after")
        assert not log.isEnabledFor(logging.INFO)
    finally:
        root.removeHandler(handler)
        log.setLevel(level)
    assert seen == []


# ---- time_limit ------------------------------------------------------------------------------


def test_time_limit_returns_the_best_plan_so_far_and_says_what_was_left(tmp_path):
    step = autopar.parallelize(
        mlp, mesh=8, engine="auto", time_limit=1e-3, progress=False, cache_dir=tmp_path
    )
    with pytest.warns(UserWarning, match="time_limit=0.001 s reached") as rec:
        p = step.plan(*args())
    msg = str(rec[0].message)
    assert "not searched" in msg and "mesh/pipeline tries" in msg and "engines" in msg
    assert any("time_limit" in w for w in p.warnings)
    assert not list(tmp_path.glob("*.pkl"))  # a cut search is not cached
    full = autopar.parallelize(mlp, mesh=8, engine="auto", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = full.plan(*args())
    assert q.cost.step_s <= p.cost.step_s


def test_time_limit_is_checked():
    with pytest.raises(autopar.AutoparError, match="time_limit"):
        autopar.parallelize(mlp, mesh=8, time_limit=0)


# ---- phases ----------------------------------------------------------------------------------


def test_phases_add_up_to_the_wall_time():
    step = autopar.parallelize(mlp, mesh=8, engine="auto", progress=False)
    t = time.perf_counter()
    p = step.plan(*args())
    wall = time.perf_counter() - t
    ph = p.phases
    for name in ("capture", "build", "recursive", "dp", "polish", "plan"):
        assert name in ph, ph
    parts = sum(v for k, v in ph.items() if k != "total")
    assert parts == pytest.approx(ph["total"], abs=1e-4)
    assert ph["total"] <= wall and ph["total"] >= 0.95 * wall - 0.01, (ph, wall)
    assert ph["other"] < 0.1 * ph["total"] + 0.02, ph
    s = p.summary()
    assert f"planned in {ph['total']:.2f} s" in s and "\n  time: " in s
    assert "phases" not in p.to_json()  # plan files stay byte-identical
    assert p.to_json(timings=True)["phases"] == ph
    from test_cli import SCHEMA, check_schema

    assert check_schema(p.to_json(timings=True), SCHEMA) == []


# ---- the incremental polish --------------------------------------------------------------------


def _gpt_small_problem():
    """gpt_small's problem on data 2 x model 4 priced on the `cpu` profile (where its
    plans pay all-reduces), and `recursive`'s plan of it."""
    import cost_models
    from autopar.cost.model import CostModel
    from autopar.examples import gpt_small
    from autopar.ir.capture import capture
    from autopar.search import engines
    from autopar.search.problem import build_problem
    from autopar.sharding import mesh_info

    w = gpt_small()
    g = capture(w.fn, w.args, (), None, ())
    profile = cost_models.load("cpu")
    info = mesh_info(autopar.make_mesh({"data": 2, "model": 4}), profile.devices_per_node)
    problem = build_problem(g, info, CostModel(profile, info), None)
    return problem, list(engines.recursive(problem, {}))


def test_incremental_pricing_matches_the_full_price():
    """Every delta the polish prices incrementally equals the full re-pricing's."""
    from autopar.search import search
    from autopar.search.polish import Pricing

    problem, rec = _gpt_small_problem()
    for choice in (rec, list(search(problem, "fsdp", float("inf")).choice)):
        _check_deltas(problem, choice)
    assert Pricing(problem, rec).saved > 0  # some all-reduces combine


def _check_deltas(problem, choice):
    from autopar.search.evaluate import step_seconds
    from autopar.search.polish import Pricing, latency_bound_moves

    pricing = Pricing(problem, choice)
    assert pricing.price == pytest.approx(step_seconds(problem, choice), rel=1e-12, abs=1e-15)
    rng = np.random.default_rng(0)
    moves = list(latency_bound_moves(problem, choice))
    n_in = problem.num_inputs
    moves += [
        (int(x), int(rng.integers(len(problem.strategies[x]))))
        for x in rng.integers(n_in, len(problem.strategies), 30)
    ]
    assert moves
    for k, (x, s) in enumerate(moves[:80]):
        trial = list(pricing.choice)
        trial[x] = s
        want = step_seconds(problem, trial) - step_seconds(problem, pricing.choice)
        got = pricing.delta(x, s)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (x, s)
        if k % 3 == 0:
            pricing.commit()
        else:
            pricing.undo()
        assert pricing.price == pytest.approx(
            step_seconds(problem, pricing.choice), rel=1e-9, abs=1e-12
        )


def test_a_group_move_put_back_restores_the_pricing():
    """`_move_all` puts a group that does not pay back by undoing its changes' logs at
    once: the price, the choice and every level and bucket are as before (a later
    delta prices as on a fresh `Pricing`), and a kept group is priced right."""
    from autopar.search.evaluate import step_seconds
    from autopar.search.polish import Pricing, _move_all

    problem, rec = _gpt_small_problem()
    pricing = Pricing(problem, rec)
    before = pricing.price
    rng = np.random.default_rng(1)
    n_in, kept = problem.num_inputs, 0
    for _ in range(6):
        xs = rng.integers(n_in, len(problem.strategies), 8)
        moves = [(int(x), int(rng.integers(len(problem.strategies[x])))) for x in xs]
        start = list(pricing.choice)
        gain = _move_all(pricing, moves)
        if gain == 0.0:
            assert pricing.choice == start and pricing.price == pytest.approx(before, rel=1e-12)
        else:
            kept += 1
            before = pricing.price
        assert pricing.price == pytest.approx(
            step_seconds(problem, pricing.choice), rel=1e-9, abs=1e-12
        )
        fresh = Pricing(problem, pricing.choice)
        x, s = moves[0]
        assert pricing.delta(x, s) == pytest.approx(fresh.delta(x, s), rel=1e-9, abs=1e-12)
        pricing.undo()
    assert kept < 6  # random groups mostly cost more: the put-back path ran


def test_reshard_tables_equal_pairwise_prices():
    """`build_edges` prices whole strategy tables at once (`autopar.cost.tables`): every
    entry equals pricing the pair on its own with `CostModel.reshard`, bit for bit, with
    and without a bucket share, for a Partial value read more than once, for scalars,
    on a mesh with an axis of size 1 (free) and axes on two link tiers."""
    import itertools

    import cost_models
    from autopar.cost.model import CostModel
    from autopar.ir.graph import TensorType
    from autopar.search.edges import reshard_matrix, reshard_seconds
    from autopar.sharding import MeshInfo, Spec

    mesh = MeshInfo.build(("stage", "data", "model", "one"), (2, 4, 2, 1), None, 8)
    cost = CostModel(cost_models.load("a100-80g"), mesh)
    axes = ("stage", "data", "model", "one")

    def specs(rank):
        out = []
        for used in itertools.permutations(axes, 2):
            for dims in itertools.product(range(rank + 1), repeat=2):
                d = [[] for _ in range(rank)]
                part = []
                for a, k in zip(used, dims):
                    (part if k == rank else d[k]).append(a)
                out.append(Spec(tuple(map(tuple, d)), tuple(part)))
        return tuple(dict.fromkeys(out))

    def reference(t, a, b, uses, share):  # the pairwise price `reshard_matrix` stands for
        p = reshard_seconds(cost, t, a, b, share)
        if uses > 1 and a.partial and not b.partial:
            whole = a.without_partial()
            summed = reshard_seconds(cost, t, a, whole, share) / uses
            p = min(p, summed + cost.reshard(t, whole, b).seconds)
        return p

    checked = 0
    for shape in [(), (8,), (64, 48), (16, 8, 40)]:
        table = specs(len(shape))
        for dtype, uses, share in [(np.float32, 1, None), (np.float32, 3, 0.01)]:
            t = TensorType(shape, np.dtype(dtype))
            got = reshard_matrix(cost, t, table, table[::-1], {}, uses, share)
            want = [[reference(t, a, b, uses, share) for b in table[::-1]] for a in table]
            assert np.array_equal(got, np.array(want)), (shape, uses, share)
            checked += got.size
    assert checked > 10_000


def test_reshard_palette_is_shared_by_builds_on_one_mesh():
    """The pair codes of a mesh's reshards (`cost.tables._palette`) are worked out once
    for every build on that mesh and profile (each try of a call builds its own
    problem), and apart for another mesh, whose pairs' step sequences, the same for
    every mesh, are not worked out again (`_Steps`); the prices are the same either
    way (the test above builds every matrix with a fresh memo, so on the shared
    palette)."""
    import cost_models
    from autopar.cost.model import CostModel
    from autopar.cost.tables import reshard_table
    from autopar.sharding import MeshInfo, Spec

    prof = cost_models.load("a100-80g")
    mesh = MeshInfo.build(("data", "model"), (4, 2), None, 8)
    specs = (Spec(((), ())), Spec((("data",), ())), Spec(((), ("model",))))
    first = reshard_table(CostModel(prof, mesh), specs, specs, {})
    again = reshard_table(
        CostModel(prof, MeshInfo.build(("data", "model"), (4, 2), None, 8)), specs, specs, {}
    )
    known = int((first.palette.all.table >= 0).sum())
    other = reshard_table(
        CostModel(prof, MeshInfo.build(("data", "model"), (2, 4), None, 8)), specs, specs, {}
    )
    assert again.palette is first.palette and other.palette is not first.palette
    assert other.palette.all is first.palette.all and (other.palette.all.table >= 0).sum() == known
    assert np.array_equal(again.codes, first.codes)


def test_node_strategies_are_shared_by_builds_on_one_mesh(monkeypatch):
    """A node's strategies are enumerated once per mesh for every build of a call (each
    try builds its own problem); a build on another mesh enumerates its own, and a
    build asked again gets the same strategy tables."""
    import cost_models
    from autopar.cost.model import CostModel
    from autopar.ir.capture import capture
    from autopar.search import build
    from autopar.search.problem import build_problem
    from autopar.sharding import MeshInfo

    def f(w, x):
        return jnp.tanh(x @ w).sum()

    graph = capture(f, (jnp.ones((32, 32)), jnp.ones((16, 32))))
    calls = []
    real = build.strategies_for
    monkeypatch.setattr(build, "strategies_for", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(build, "_STRATEGIES", type(build._STRATEGIES)())
    prof = cost_models.load("a100-80g")
    meshes = [MeshInfo.build(("data", "model"), s, None, 8) for s in ((4, 2), (4, 2), (2, 4))]
    problems, counts = [], []
    for mesh in meshes:
        problems.append(build_problem(graph, mesh, CostModel(prof, mesh)))
        counts.append(len(calls))
        calls.clear()
    assert counts[0] > 0 and counts[1] == 0 and counts[2] == counts[0], counts
    assert problems[1].strategies == problems[0].strategies
    assert problems[2].strategies != problems[0].strategies


def _counting_traces(monkeypatch, layers: int):
    """A tiny scanned GPT's step (`ts`, `cfg`) and the token batch of every trace the
    driver makes of it from now on (the micro-batch traces: the full one is made before)."""
    from autopar.compile import driver
    from autopar.examples.models import gpt

    cfg = gpt.GPTConfig(
        hidden=32, heads=2, seq=16, vocab=64, layers=layers, batch_size=8, scan_layers=True
    )
    batches = []
    real = driver.capture

    def counting(fn, args, *rest, **kw):
        batches.append(jax.tree.leaves(args)[-1].shape[0])  # the token batch
        return real(fn, args, *rest, **kw)

    monkeypatch.setattr(driver, "capture", counting)
    return gpt.make_train_step(cfg), cfg, batches


@pytest.mark.slow  # 50 s: four remat policies' pipelined searches
def test_remat_auto_traces_a_pipelines_micro_batch_once(monkeypatch):
    """`remat="auto"` searches each remat policy with its own driver; the pipeline's
    micro-batch trace (the user's function at the micro-batch size, seconds on a
    large unrolled model) is made once per mesh and micro-batch count, not once per
    policy."""
    from autopar.errors import MemoryBudgetError
    from autopar.examples.models import gpt

    ts, cfg, batches = _counting_traces(monkeypatch, layers=2)
    with pytest.raises(MemoryBudgetError):
        _every_remat_policy(ts.step).plan(*gpt.abstract_args(cfg))
    assert batches.count(4) == 1, batches  # micro-batch traces (batch 8 / 2)


def _every_remat_policy(step):
    """`step` parallelized with `remat="auto"` on a 2-stage pipeline of 2 micro-batches
    where nothing fits, so that every remat policy is tried."""
    return autopar.parallelize(
        step,
        mesh={"stage": 2, "data": 2, "model": 2},
        cluster="cpu",
        pipeline_stages=2,
        microbatches=2,
        remat="auto",
        memory_budget=1,
        engine="recursive",
    )


def test_pipeline_candidates_share_a_micro_batch_trace(monkeypatch):
    """`pipeline_stages="auto"` over every mesh shape: candidates with the same
    micro-batch count (2 stages x 4 micro-batches, 4 x 4, ...) share one trace of the
    step at that size (the step has no sharding constraint naming mesh axes)."""
    from autopar.examples.models import gpt

    ts, cfg, batches = _counting_traces(monkeypatch, layers=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # time_limit's "not searched" warning
        plan = autopar.parallelize(
            ts.step,
            mesh=8,
            cluster="cpu",
            pipeline_stages="auto",
            engine="recursive",
            time_limit=0.001,  # every candidate is set up, one is searched
        ).plan(*gpt.abstract_args(cfg))
    assert plan is not None
    micro = [b for b in batches if b < 8]
    assert sorted(micro) == sorted(set(micro)) and len(micro) >= 2, batches


def test_planning_keeps_the_capture_out_of_garbage_collections_and_puts_it_back(
    tmp_path, monkeypatch
):
    """While a plan is searched, what existed before it and the captured graph are
    frozen (`gc.freeze`: Python's full collections do not walk them); afterwards the
    heap is as it was: nothing stays frozen, also when the search raises."""
    import gc

    from autopar.compile import driver

    seen = []
    build = driver._Driver._built

    def watched(self, *a, **k):
        seen.append(gc.get_freeze_count())
        return build(self, *a, **k)

    monkeypatch.setattr(driver._Driver, "_built", watched)
    before = gc.get_freeze_count()
    plan(tmp_path)
    assert seen and min(seen) > before  # frozen while the problem is built and searched
    assert gc.get_freeze_count() == before

    def fail(self, *a, **k):
        raise RuntimeError("search failed")

    monkeypatch.setattr(driver._Driver, "_built", fail)
    with pytest.raises(RuntimeError, match="search failed"):
        plan(tmp_path, batch=32)
    assert gc.get_freeze_count() == before


def test_remat_auto_rolls_an_unrolled_stack_once(monkeypatch):
    """The remat policies' drivers share the roll of a stack unrolled in Python into
    loops (`passes.roll`, a capture of the rolled step: seconds on a large model): one
    full-size roll per stage count, not one per policy; each policy rematerializes it."""
    from autopar.compile import pipelines
    from autopar.errors import MemoryBudgetError
    from autopar.examples.models import gpt

    cfg = gpt.GPTConfig(
        hidden=32, heads=2, seq=16, vocab=64, layers=2, batch_size=8, scan_layers=False
    )
    batches, real = [], pipelines.roll

    def counting(graph, *rest, **kw):
        batches.append(graph.values[graph.inputs[-1]].shape[0])  # the token batch
        return real(graph, *rest, **kw)

    monkeypatch.setattr(pipelines, "roll", counting)
    with pytest.raises(MemoryBudgetError, match="remat=full"):
        _every_remat_policy(gpt.make_train_step(cfg).step).plan(*gpt.abstract_args(cfg))
    assert batches.count(8) == 1 and batches.count(4) == 1, batches


def test_a_later_remat_policy_leaves_out_the_tries_the_ones_before_rule_out():
    """`remat="auto"`'s policies each recompute what the one before does and more, so a
    try's fastest plan of any memory under one policy, plus the FLOPs the next
    recomputes on top at the peak rate, bounds its price under the next from below: the
    next leaves out a try whose bound is at or above the best plan made, and the plan
    says so. (GPT-3 175B unrolled: the full policy searched 25 (mesh, pipeline) tries
    whose plans all cost more than selective's best.)"""
    from autopar.compile.pipelines import Infeasible
    from autopar.compile.tries import Earlier, bound
    from autopar.cost.model import Cost
    from autopar.errors import MemoryBudgetError
    from autopar.passes.pipeline import Pipeline
    from autopar.search.result import SearchResult

    def cost(s: float, gib: float) -> Cost:
        return Cost(s, 0.0, gib * 2**30, 0.0, {})

    fits, over = cost(3.0, 1), cost(2.0, 9)  # the faster plan is over the budget
    result = SearchResult((0,), "dp", fits, 0.0, {"dp": over, "dp+zero3": fits})
    assert bound(result, (), None) == 2.0  # the fastest of any memory
    err = MemoryBudgetError("none fits")
    err.fastest = 2.5
    assert bound(Infeasible(err), (), None) == 2.5
    assert bound(Infeasible(MemoryBudgetError("never searched")), (), None) == 0.0

    class ZB:  # a try's ZB-H1 form: 4 stages x 12 micro-batches, a bubble of 3/15
        pipe = Pipeline(4, 12, "zb-h1")

    assert bound(result, (), ZB()) == pytest.approx(2.0 * (1 - 3 / 15))
    assert bound(result, (("dp", (0,), cost(1.5, 1)),), ZB()) == 1.5  # repriced, fitting

    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
    tries = [(0, mesh, None), (1, mesh, None)]
    earlier = Earlier(best=2.4)
    earlier.add(tries[0], 2.0, 1.0, "dots")
    earlier.add(tries[1], 2.3, 1.0, "dots")
    # the next policy's FLOP floors: 0.5 s more compute on the first, 0.05 on the second
    assert earlier.settled(tries, [1.5, 1.05], "selective") == {0}
    assert earlier.left["selective"] == "1 of 2 tries ruled out unsearched"
    assert "under remat=dots" in earlier.note({0}, tries, "selective")
    assert Earlier().settled(tries, [1.5, 1.05], "dots") == set()  # nothing known yet


@pytest.mark.slow  # ~1 minute: three searches of 7 mesh shapes (the rule: the test above)
def test_remat_auto_plans_alike_with_the_tries_it_rules_out_left_out(monkeypatch):
    """On a mesh-shape search under a budget that holds `remat="none"`'s fastest plan
    back, `"dots"` leaves out the shapes `"none"` rules out, and the plan is the one
    searching them all gives."""
    import autopar.compile.tries as tries_module
    from autopar.examples.models import gpt

    cfg = gpt.GPTConfig(
        hidden=256, heads=4, seq=128, vocab=512, layers=4, batch_size=32, scan_layers=True
    )
    ts, args = gpt.make_train_step(cfg), gpt.abstract_args(cfg)
    free = autopar.parallelize(ts.step, mesh=16, cluster="a100-80g", progress=False)
    costs = list(free.plan(*args).candidates.values())
    fastest = min(costs, key=lambda c: c.step_s)
    smaller = [
        c.peak_memory_bytes for c in costs if c.peak_memory_bytes < fastest.peak_memory_bytes
    ]
    budget = (fastest.peak_memory_bytes + max(smaller)) / 2

    def plan():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # not compile-checked: no devices for the mesh
            return autopar.parallelize(
                ts.step, mesh=16, cluster="a100-80g", remat="auto", memory_budget=budget,
                progress=False,
            ).plan(*args)  # fmt: skip

    pruned = plan()
    (note,) = [w for w in pruned.warnings if w.startswith("remat='auto' tried ")]
    assert "remat=dots: " in note and "tries ruled out unsearched)" in note, note
    monkeypatch.setattr(tries_module.Earlier, "settled", lambda self, *a: set())
    every = plan()
    assert (pruned.mesh.shape, pruned.engine, pruned.remat) == (
        every.mesh.shape,
        every.engine,
        every.remat,
    )
    assert pruned.cost.step_s == every.cost.step_s


def test_a_state_made_again_takes_the_plan_of_the_same_program(monkeypatch):
    """A flax `TrainState` made again holds a new optax transformation (functions, equal
    by identity), so a call with it misses the compiled programs' cache as `jax.jit`'s
    does, and was searched again (a trial: `.plan(create_state(), ...)`, then the
    training loop's own `create_state()`, then `.lower(create_state(), ...)`: three
    searches). A call that traces to the same program takes the plan made: one search,
    and the steps equal `jax.jit`'s."""
    import optax
    from flax.training import train_state

    import autopar.compile.step as step_module

    def create():
        params = {"w1": jnp.eye(64) * 0.5, "w2": jnp.ones((64, 8)) / 64}
        return train_state.TrainState.create(apply_fn=mlp, params=params, tx=optax.adam(1e-2))

    def step(state, x):
        loss, grads = jax.value_and_grad(lambda p: state.apply_fn(p, x))(state.params)
        return state.apply_gradients(grads=grads), loss

    searched, real = [], step_module._compile
    monkeypatch.setattr(step_module, "_compile", lambda *a: searched.append(1) or real(*a))
    x = jnp.linspace(-1, 1, 128 * 64).reshape(128, 64)
    par = autopar.parallelize(step, mesh={"data": 8}, cluster="cpu", progress=False)
    plan = par.plan(create(), x)
    ours, ref = create(), create()
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the plan's warnings were given with `.plan()`
            ours, loss = par(ours, x)
        ref, want = jax.jit(step)(ref, x)
        assert jnp.allclose(loss, want, rtol=1e-5, atol=1e-6)
    assert par.plan(create(), x).fingerprint == plan.fingerprint
    assert len(searched) == 1, searched
