"""The public API: `autopar.parallelize`, its cache, `Plan` files and user-facing errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_trees_close, is_sharded, run_steps, spec_leaves
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

import autopar
import autopar.compile.driver
import autopar.compile.step
from autopar.examples.models import mlp

MESH = {"data": 2, "model": 4}
CONFIG = mlp.MLPConfig()


@pytest.fixture(scope="module")
def ts():
    return mlp.make_train_step(CONFIG)


@pytest.fixture(scope="module")
def state(ts):
    return jax.jit(ts.init)(0)


@pytest.fixture(scope="module")
def searched(ts):
    """One searched step function shared by the tests that only read its plan."""
    return autopar.parallelize(ts.step, mesh=MESH)


def _tanh_matmul(w, x):
    return jnp.tanh(x @ w)


def _residual(w, x):
    """Output shaped like ``x``, so a donated ``x`` can hold it."""
    return x + jnp.tanh(x @ w) @ w.T


def _w_x(batch: int = 16):
    w = (jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) % 7 - 3) / 16
    x = (jnp.arange(batch * 64, dtype=jnp.float32).reshape(batch, 64) % 11 - 5) / 32
    return w, x


def _count_captures(monkeypatch) -> list:
    """Record every trace autopar makes (a trace precedes every search)."""
    calls = []
    real = autopar.compile.driver.capture

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    # the first trace of a call is compile.step's (it keys the plan cache); re-captures
    # for accumulation and pipelines are the driver's
    monkeypatch.setattr(autopar.compile.step, "capture", counting)
    monkeypatch.setattr(autopar.compile.driver, "capture", counting)
    return calls


# ---------------------------------------------------------------------------------------
# Calling conventions and the per-signature cache
# ---------------------------------------------------------------------------------------


def test_decorator_form():
    @autopar.parallelize(mesh=MESH)
    def f(w, x):
        """Docstring kept."""
        return jnp.tanh(x @ w)

    assert isinstance(f, autopar.Parallelized)
    assert f.__name__ == "f" and f.__doc__ == "Docstring kept."
    w, x = _w_x()
    assert_trees_close(f(w, x), jax.jit(_tanh_matmul)(w, x))


def test_cache_per_signature(ts, state, monkeypatch):
    traces = _count_captures(monkeypatch)
    step = autopar.parallelize(ts.step, mesh=MESH)
    step(state, ts.batch(0))
    assert len(step._cache) == 1 and len(traces) == 1
    plan = step.plan(state, ts.batch(0))
    # Same shapes, different values: no new trace, no new search.
    step(state, ts.batch(1))
    assert step.plan(state, ts.batch(1)) is plan
    assert step.plan(*mlp.abstract_args(CONFIG)) is plan  # abstract args hit the cache too
    assert len(step._cache) == 1 and len(traces) == 1
    # A new batch shape is a new signature.
    small = jax.tree_util.tree_map(lambda a: a[:8], ts.batch(0))
    step(state, small)
    assert len(step._cache) == 2 and len(traces) == 2
    assert step.plan(state, small).inputs[-1].shape == (8, CONFIG.dout)
    step(state, ts.batch(2))
    assert len(step._cache) == 2 and len(traces) == 2


def test_plan_with_shape_dtype_structs(ts, state, searched):
    state_sds, batch_sds = mlp.abstract_args(CONFIG)
    assert isinstance(jax.tree_util.tree_leaves(state_sds)[0], jax.ShapeDtypeStruct)
    plan = searched.plan(state_sds, batch_sds)
    assert isinstance(plan, autopar.Plan)
    # The abstract plan is the one a concrete call uses.
    assert searched.plan(state, ts.batch(0)) is plan
    assert [r.shape for r in plan.inputs] == [
        tuple(x.shape) for x in jax.tree_util.tree_leaves((state_sds, batch_sds))
    ]


def test_plan_pytrees_and_shardings(ts, state, searched):
    args = (state, ts.batch(0))
    plan = searched.plan(*args)
    is_spec = lambda x: isinstance(x, PartitionSpec)
    assert jax.tree_util.tree_structure(plan.in_specs, is_leaf=is_spec) == (
        jax.tree_util.tree_structure(args)
    )
    out_shape = jax.eval_shape(ts.step, *args)
    assert jax.tree_util.tree_structure(plan.out_specs, is_leaf=is_spec) == (
        jax.tree_util.tree_structure(out_shape)
    )
    for tree in (plan.in_shardings, plan.out_shardings):
        leaves = jax.tree_util.tree_leaves(tree)
        assert leaves and all(isinstance(s, NamedSharding) for s in leaves)
        assert all(s.mesh == searched.mesh for s in leaves)
    for spec, sds in zip(spec_leaves(plan.in_specs), jax.tree_util.tree_leaves(args)):
        assert len(spec) <= sds.ndim
    text = str(plan)
    assert plan.engine in text and f"engine {plan.engine}" in text
    assert "params/dense_0/kernel" in text


# ---------------------------------------------------------------------------------------
# Plan files
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_step(ts):
    """An fsdp plan: sharded parameters and partial sums, so the file holds every kind
    of spec."""
    return autopar.parallelize(ts.step, mesh=MESH, engine="fsdp")


def test_plan_save_load_round_trip(ts, state, fsdp_step, tmp_path):
    plan = fsdp_step.plan(state, ts.batch(0))
    assert any(is_sharded(s) for s in spec_leaves(plan.in_specs))
    assert any(s.partial for op in plan.ops for s in op.out_specs)  # partial sums saved too
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded.to_json() == plan.to_json()
    again = tmp_path / "again.json"
    loaded.save(again)
    assert again.read_text() == path.read_text()
    assert json.loads(path.read_text())["format"] == "autopar.plan/1"
    # Unbound, the specs are keyed by argument path.
    assert (
        loaded.in_specs["state/params/dense_0/kernel"]
        == (plan.in_specs[0]["params"]["dense_0"]["kernel"])
    )

    reused = autopar.parallelize(ts.step, mesh=MESH, plan=path)
    bound = reused.plan(state, ts.batch(0))
    assert bound.to_json() == plan.to_json()
    assert bound.in_specs == plan.in_specs
    ref_losses, ref_state = run_steps(fsdp_step, state, ts.batch, 2)
    losses, new_state = run_steps(reused, state, ts.batch, 2)
    assert_trees_close(losses, ref_losses, rtol=0, atol=0)  # the same program
    assert_trees_close(new_state, ref_state, rtol=0, atol=0)
    jit_losses, _ = run_steps(jax.jit(ts.step), state, ts.batch, 2)
    assert_trees_close(losses, jit_losses)
    # A Plan object works as well as a path.
    assert autopar.parallelize(ts.step, mesh=MESH, plan=loaded).plan(state, ts.batch(0)).to_json()


def test_plan_for_another_function_raises(tmp_path):
    w, x = _w_x()
    path = tmp_path / "plan.json"
    autopar.parallelize(_tanh_matmul, mesh=MESH).plan(w, x).save(path)

    def transposed(w, x):
        return jnp.tanh(x @ w.T)

    with pytest.raises(autopar.PlanError) as e:
        autopar.parallelize(transposed, mesh=MESH, plan=path)(w.T, x)
    msg = str(e.value)
    assert "w: plan float32[64, 32] vs function float32[32, 64]" in msg
    assert "x:" not in msg  # only the differing argument is named

    assert "different function" in msg

    # Same function, another batch shape: names the argument and both shapes, says the
    # plan is for other shapes (not another function) and offers allow_partial=True.
    with pytest.raises(
        autopar.PlanError, match=r"x: plan float32\[16, 64\] vs function float32\[8, 64\]"
    ) as e:
        autopar.parallelize(_tanh_matmul, mesh=MESH, plan=path).plan(w, x[:8])
    assert "other argument shapes" in str(e.value) and "allow_partial=True" in str(e.value)

    # Same shapes, another computation.
    with pytest.raises(autopar.PlanError, match="different computation"):
        autopar.parallelize(lambda w, x: jnp.sin(x @ w), mesh=MESH, plan=path).plan(w, x)

    # Another mesh.
    with pytest.raises(autopar.PlanError, match="mesh"):
        autopar.parallelize(_tanh_matmul, mesh={"data": 8}, plan=path).plan(w, x)


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda text: text[: len(text) // 2], id="truncated"),
        pytest.param(lambda text: "", id="empty"),
        pytest.param(lambda text: text.replace("{", "[", 3), id="garbled"),
        pytest.param(lambda text: text.replace('"inputs"', '"inputz"'), id="missing-key"),
        pytest.param(lambda text: text.replace("autopar.plan/1", "autopar.plan/0"), id="format"),
        pytest.param(lambda text: "[1, 2]", id="not-an-object"),
    ],
)
def test_corrupted_plan_file_raises_one_line(corrupt, tmp_path):
    w, x = _w_x()
    path = tmp_path / "plan.json"
    autopar.parallelize(_tanh_matmul, mesh=MESH).plan(w, x).save(path)
    path.write_text(corrupt(path.read_text()))
    for load in (
        lambda: autopar.Plan.load(path),
        lambda: autopar.parallelize(_tanh_matmul, mesh=MESH, plan=path),
    ):
        with pytest.raises(autopar.PlanError) as e:
            load()
        msg = str(e.value)
        assert "\n" not in msg and str(path) in msg, msg


def test_missing_plan_file(tmp_path):
    with pytest.raises(autopar.PlanError, match="does not exist"):
        autopar.parallelize(_tanh_matmul, mesh=MESH, plan=tmp_path / "nope.json")


# ---------------------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------------------


def test_abstract_mesh_bigger_than_the_devices():
    step = autopar.parallelize(mlp.make_train_step(CONFIG).step, mesh={"data": 16, "model": 8})
    assert isinstance(step.mesh, AbstractMesh)
    state_sds, batch_sds = mlp.abstract_args(CONFIG)
    batch_sds = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct((128,) + a.shape[1:], a.dtype), batch_sds
    )
    plan = step.plan(state_sds, batch_sds)
    assert plan.mesh.axis_sizes == (16, 8)
    lowered = step.lower(state_sds, batch_sds)
    assert isinstance(lowered, jax.stages.Lowered)
    assert "sharding" in lowered.as_text()
    with pytest.raises(autopar.PlanError, match="abstract"):
        plan.in_shardings  # noqa: B018
    state = jax.jit(mlp.make_train_step(CONFIG).init)(0)
    batch = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), batch_sds)
    with pytest.raises(autopar.MeshError) as e:
        step(state, batch)
    msg = str(e.value)
    assert "128" in msg and "8" in msg.replace("128", "")


def test_mesh_forms(ts, state):
    """A jax Mesh and an AbstractMesh of the right size work like the dict."""
    w, x = _w_x()
    ref = jax.jit(_tanh_matmul)(w, x)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    out = autopar.parallelize(_tanh_matmul, mesh=mesh)(w, x)
    assert_trees_close(out, ref)
    assert out.sharding.mesh.axis_names == ("data", "model")
    abstract = AbstractMesh((2, 4), ("data", "model"))
    planned = autopar.parallelize(_tanh_matmul, mesh=abstract).plan(w, x)
    assert planned.mesh.axis_sizes == (2, 4)


@pytest.mark.parametrize(
    "mesh",
    [
        {"data": 2.0, "model": 4},
        {"data": "2"},
        {"data": 0},
        {"data": -2},
        {"data": None},
        {"data": True},
        {},
        [2, 4],
    ],
    ids=["float", "str", "zero", "negative", "none", "bool", "empty", "list"],
)
def test_bad_mesh_raises_mesh_error(mesh):
    with pytest.raises(autopar.MeshError):
        autopar.parallelize(_tanh_matmul, mesh=mesh)


# ---------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------


def test_memory_budget_too_small(ts, state):
    step = autopar.parallelize(ts.step, mesh=MESH, memory_budget=1000)
    with pytest.raises(autopar.MemoryBudgetError) as e:
        step(state, ts.batch(0))
    msg = str(e.value)
    assert "smallest" in msg and "1000 B" in msg


def test_unknown_engine_lists_the_engines():
    w, x = _w_x()
    with pytest.raises(autopar.AutoparError, match="bogus") as e:
        autopar.parallelize(_tanh_matmul, mesh=MESH, engine="bogus")(w, x)
    for engine in ("auto", "recursive", "dp", "ilp", "data", "fsdp"):
        assert engine in str(e.value)


@pytest.mark.parametrize("engine", ["recursive", "dp", "data", "fsdp", "ilp"])
def test_every_engine_runs(engine):
    w, x = _w_x()
    step = autopar.parallelize(_tanh_matmul, mesh=MESH, engine=engine)
    assert_trees_close(step(w, x), jax.jit(_tanh_matmul)(w, x))
    assert step.plan(w, x).engine.split("+")[0] == engine


@pytest.mark.parametrize(
    "fn, primitive",
    [
        (lambda a: jax.lax.linalg.cholesky(a @ a.T + 8 * jnp.eye(8)), "cholesky"),
        (lambda a: jnp.linalg.inv(a @ a.T + 8 * jnp.eye(8)) * 2.0, "lu"),
    ],
    ids=["cholesky", "inv"],
)
def test_unsupported_primitive_runs_replicated_with_warning(fn, primitive):
    a = (jnp.arange(64, dtype=jnp.float32).reshape(8, 8) % 5 - 2) / 8
    step = autopar.parallelize(fn, mesh={"data": 8})
    assert_trees_close(step(a), jax.jit(fn)(a))
    warnings = step.plan(a).warnings
    assert any(f"'{primitive}'" in w for w in warnings), warnings
    assert f"'{primitive}'" in str(step.plan(a))


def test_donate_argnums(ts, state):
    step = autopar.parallelize(ts.step, mesh=MESH, donate_argnums=(0,))
    plan = step.plan(state, ts.batch(0))
    # Like jax.jit, only an argument already laid out as the plan wants can be donated
    # (anything else is copied into place first, and the copy is donated).
    # (A replicated device_put may share the source's buffer on its first device, so the
    # donated copy is made from a private copy of the shared fixture.)
    own = jax.tree_util.tree_map(jnp.copy, state)
    placed = jax.device_put(own, plan.in_shardings[0])
    batch = ts.batch(0)
    new_state, metrics = step(placed, batch)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(placed))
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(batch))
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(state))
    ref_state, ref_metrics = jax.jit(ts.step)(state, batch)
    assert_trees_close(metrics, ref_metrics)
    assert_trees_close(new_state["opt_state"], ref_state["opt_state"])
    # The int form. Donation only frees a buffer an output of the same per-device shape
    # can reuse (else XLA warns "Some donated buffers were not usable" and keeps it), so
    # use an elementwise function whose plan keeps the layout.
    donate_x = autopar.parallelize(_affine, mesh=MESH, donate_argnums=0)
    w, x = _w_x()
    plan = donate_x.plan(x)
    assert plan.in_specs[0] == plan.out_specs, str(plan)
    ref = jax.jit(_affine)(x)
    x = jax.device_put(jnp.copy(x), plan.in_shardings[0])
    assert_trees_close(donate_x(x), ref)
    assert x.is_deleted()


def _affine(x):
    return x * 2.0 + 1.0


def test_jax_jit_donation_carried_over():
    """A step already under `jax.jit(..., donate_argnums=0)` keeps its donation when
    autopar replaces the jit (it was dropped without a word)."""
    f = autopar.parallelize(jax.jit(_affine, donate_argnums=0), mesh=MESH)
    assert f.donate_argnums == (0,)
    w, x = _w_x()
    x = jax.device_put(jnp.copy(x), f.plan(x).in_shardings[0])
    f(x)
    assert x.is_deleted()


def test_bare_array_state_keeps_its_layout():
    """A step whose state is a bare array beside another bare array (`step(w, x) ->
    (w - g, loss)`) returns the new `w` in `w`'s layout, so it is not resharded every
    call and its donation is used (both arguments' paths are bare: the new `w` matches
    `w`, the one of its type)."""

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    w = jnp.arange(256 * 256, dtype=jnp.float32).reshape(256, 256) / 65536.0
    x = jnp.cos(jnp.arange(16 * 256, dtype=jnp.float32)).reshape(16, 256)
    f = autopar.parallelize(step, mesh=MESH, donate_argnums=0)
    plan = f.plan(w, x)
    assert plan.in_specs[0] == plan.out_specs[0], str(plan)
    placed = jax.device_put(jnp.copy(w), plan.in_shardings[0])
    new_w, loss = f(placed, x)
    assert placed.is_deleted()
    ref_w, ref_loss = jax.jit(step)(w, x)
    assert_trees_close((new_w, loss), (ref_w, ref_loss))


def test_static_argnums(monkeypatch):
    def scaled(w, power, x):
        assert isinstance(power, int)
        return _residual(w, x) ** power

    traces = _count_captures(monkeypatch)
    step = autopar.parallelize(scaled, mesh=MESH, static_argnums=(1,))
    w, x = _w_x()
    for power in (1, 2, 1, 3):
        assert_trees_close(step(w, power, x), jax.jit(scaled, static_argnums=1)(w, power, x))
    assert len(step._cache) == 3 and len(traces) == 3
    plan = step.plan(w, 2, x)
    # The static argument is not an input of the plan.
    assert [r.path for r in plan.inputs] == ["w", "x"]
    assert len(plan.in_specs) == 2


def test_static_and_donated_argnums_count_full_positions():
    """donate_argnums index the full argument list, static arguments included."""

    def powered(power, x):
        return x**power

    step = autopar.parallelize(powered, mesh=MESH, static_argnums=0, donate_argnums=1)
    _, x = _w_x()
    plan = step.plan(3, x)
    assert plan.in_specs[0] == plan.out_specs, str(plan)
    ref = jax.jit(powered, static_argnums=0)(3, x)
    x = jax.device_put(jnp.copy(x), plan.in_shardings[0])
    assert_trees_close(step(3, x), ref)
    assert x.is_deleted()


# ---------------------------------------------------------------------------------------
# Regressions of bugs found and fixed
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", [lambda: jax.random.key(0), lambda: jax.random.PRNGKey(0)], ids=["typed", "raw"]
)
def test_function_using_jax_random(key):
    def dropout(k, x):
        k = jax.random.clone(k)  # as `nn.remat` with split RNGs does: `random_clone`
        return jnp.where(jax.random.bernoulli(k, 0.5, x.shape), x, 0.0)

    _, x = _w_x()
    step = autopar.parallelize(dropout, mesh=MESH)
    # jnp.where inserts a `reshard` under the mesh: an identity on Auto axes, not an
    # op without a rule that runs replicated
    assert not [w for w in step.plan(key(), x).warnings if "no sharding rule" in w]
    assert_trees_close(step(key(), x), jax.jit(dropout)(key(), x))


def test_typed_key_argument_is_listed_with_its_key_dtype(tmp_path):
    """A typed PRNG key (`jax.random.key`, what `nnx.Rngs` holds) is priced as its
    uint32 words, but the plan lists it as the user passed it, not as a uint32 scalar;
    a raw `PRNGKey` stays the uint32[2] it is."""
    from autopar.tools import inspect as insp
    from autopar.tools.inspect.format import full_bytes

    def dropout(k, x):
        k = jax.random.clone(k)  # as `nn.remat` with split RNGs does: `random_clone`
        return jnp.where(jax.random.bernoulli(k, 0.5, x.shape), x, 0.0)

    _, x = _w_x()
    step = autopar.parallelize(dropout, mesh=MESH)
    plan = step.plan(jax.random.key(0), x)
    assert (plan.inputs[0].dtype, plan.inputs[0].shape) == ("key<fry>", ())
    assert "key<fry>[]" in str(plan) and "uint32" not in str(plan), str(plan)
    plan.save(tmp_path / "p.json")
    loaded = autopar.Plan.load(tmp_path / "p.json")
    assert loaded.inputs[0].dtype == "key<fry>"
    assert full_bytes(loaded.inputs[0]) == jax.random.key(0).dtype.itemsize
    assert "key<fry>" in insp.render_inspect(loaded, "table", "param")
    # the plan file replays on the key it was made for
    again = autopar.parallelize(dropout, mesh=MESH, plan=tmp_path / "p.json")
    assert_trees_close(again(jax.random.key(0), x), jax.jit(dropout)(jax.random.key(0), x))
    raw = step.plan(jax.random.PRNGKey(0), x).inputs[0]
    assert (raw.dtype, raw.shape) == ("uint32", (2,))


def test_negative_static_argnums():
    def rows(x, n):
        return x.reshape(n, -1) * 2.0

    _, x = _w_x()
    step = autopar.parallelize(rows, mesh=MESH, static_argnums=-1)
    assert_trees_close(step(x, 4), jax.jit(rows, static_argnums=-1)(x, 4))


def test_abstract_mesh_that_fits_the_devices_runs():
    w, x = _w_x()
    step = autopar.parallelize(_tanh_matmul, mesh=AbstractMesh((2, 4), ("data", "model")))
    assert_trees_close(step(w, x), jax.jit(_tanh_matmul)(w, x))


def test_allow_partial_reuses_what_still_matches(tmp_path):
    """A plan for an older version of the function: refused by default; with
    allow_partial=True the matching argument specs are kept and the rest searched."""

    def old(w, x):
        return jnp.tanh(x @ w).sum()

    def new(w, x, b):
        return jnp.tanh(x @ w + b).sum()

    w, x, b = (
        jnp.ones((64, 32)) / 64,
        jnp.arange(16 * 64, dtype=jnp.float32).reshape(16, 64) / 1e3,
        jnp.ones(32),
    )
    mesh = {"data": 2, "model": 4}
    path = tmp_path / "old.json"
    autopar.parallelize(old, mesh=mesh, engine="fsdp").plan(w, x).save(path)
    with pytest.raises(autopar.PlanError, match="different function"):
        autopar.parallelize(new, mesh=mesh, plan=path).plan(w, x, b)
    step = autopar.parallelize(new, mesh=mesh, plan=path, allow_partial=True)
    plan = step.plan(w, x, b)
    saved = autopar.Plan.load(path)
    assert plan.in_specs[0] == saved.in_specs["w"] and plan.in_specs[1] == saved.in_specs["x"]
    assert "kept the specs of 2 of 3 arguments" in plan.warnings[0]
    assert_trees_close(step(w, x, b), jax.jit(new)(w, x, b))


def test_the_summary_says_how_much_of_the_work_runs_split():
    """`Plan.replicated_share`: a data-parallel MLP step splits nearly all its work; the
    same ops made whole on every device are all replicated, and the summary says so."""
    from dataclasses import replace

    from autopar.sharding import Spec

    def step(w, x):
        def loss(w):
            return jnp.mean(jnp.tanh(x @ w["a"]) @ w["b"])

        return jax.tree.map(lambda p, g: p - 0.1 * g, w, jax.grad(loss)(w))

    f = jnp.float32
    w = {"a": jax.ShapeDtypeStruct((64, 128), f), "b": jax.ShapeDtypeStruct((128, 8), f)}
    x = jax.ShapeDtypeStruct((512, 64), f)
    split = autopar.parallelize(step, mesh={"data": 8}, engine="data").plan(w, x)
    assert split.replicated_share() < 0.2, split.summary()
    # the same ops, each made whole on every device
    whole = replace(
        split,
        ops=tuple(
            replace(op, out_specs=tuple(Spec.replicated(len(sp.dims)) for sp in op.out_specs))
            for op in split.ops
        ),
    )
    assert whole.replicated_share() == 1.0
    assert "work: 0% of the ops' compute split over devices, 100% replicated" in whole.summary()


def test_the_work_line_counts_a_loop_by_its_body():
    """A step that scans over micro-batches itself (gradient accumulation by hand) runs
    its loop body split over the batch while the loop's results (the summed gradients)
    are whole: the work line reads the body's ops (it said 100% replicated)."""

    def step(w, xs):
        def micro(g, x):
            return g + jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w), None

        g, _ = jax.lax.scan(micro, jnp.zeros_like(w), xs)
        return w - 0.1 * g

    from dataclasses import replace

    from autopar.sharding import Spec

    f = jnp.float32
    w, xs = jax.ShapeDtypeStruct((64, 128), f), jax.ShapeDtypeStruct((4, 512, 64), f)
    plan = autopar.parallelize(step, mesh={"data": 8}).plan(w, xs)
    assert plan.replicated_share() < 0.2, plan.summary()
    # the loop's results made whole (as the helper's accumulation step had them): the
    # share is still its body's
    whole = tuple(
        replace(op, out_specs=tuple(Spec.replicated(len(sp.dims)) for sp in op.out_specs))
        if op.body is not None
        else op
        for op in plan.ops
    )
    assert replace(plan, ops=whole).replicated_share() == pytest.approx(plan.replicated_share())


def test_train_state_python_step_counter_is_one_signature():
    """`TrainState.create` starts `step` as the Python int 0, which `jax.jit` traces as
    a weakly typed int32 scalar and returns as one: the next calls pass that array, and
    autopar does not search again (it did: the int and the array were two signatures,
    and the second plan, traced without the weak type, returned a strongly typed
    counter, which a third call compiled for again), nor compile again (it did: jit keys
    a Python scalar apart from an array, so the int is put on the mesh as the array the
    step returns for it)."""
    import flax.linen as nn
    import optax
    from flax.training import train_state

    model = nn.Dense(8)
    x = jnp.arange(64.0).reshape(8, 8) / 64
    params = model.init(jax.random.key(0), x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    assert isinstance(state.step, int)

    def step(state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(
            state.params
        )
        return state.apply_gradients(grads=grads), loss

    par = autopar.parallelize(step, mesh=MESH)
    a, b = state, state
    for _ in range(3):
        a, la = jax.jit(step)(a, x)
        b, lb = par(b, x)
        assert_trees_close(lb, la)
    assert_trees_close(b.params, a.params)
    assert int(b.step) == 3 and b.step.weak_type == a.step.weak_type
    assert len(par._cache) == 1  # one search
    (compiled,) = par._cache.values()
    assert compiled.jitted._cache_size() == 1  # one trace and compile
