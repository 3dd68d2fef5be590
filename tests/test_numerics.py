"""The core claim: the sharded program computes what the single-device program computes.

Every example model runs a few AdamW steps through ``autopar.parallelize`` and through
plain ``jax.jit`` from the same initial state on position-dependent batches; losses,
updated states (params, optimizer state, batch statistics) and gradients must agree.
A compiled program's collectives must also agree with what the plan predicted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, is_sharded, run_steps, shard_shape, spec_leaves
from jax.sharding import NamedSharding

import autopar
from autopar.examples.models import cnn, embedding, gpt, mlp
from autopar.meshes import make_mesh
from autopar.tools.hlo import parse_collectives

STEPS = 3
LEARNING_RATE = 1e-2
# Plan for the machine the tests run on: the models are small enough that on a GPU
# profile replicating everything is (rightly) fastest, which would test nothing.
CLUSTER = "cpu"

MODELS = {
    "mlp": (mlp, mlp.MLPConfig()),
    "gpt": (gpt, gpt.GPTConfig(hidden=128, heads=4, seq=64, vocab=512, layers=2, batch_size=16)),
    "cnn": (cnn, cnn.CNNConfig()),
    "embedding": (embedding, embedding.EmbeddingConfig()),
    # layers under nn.scan: the scan bodies (forward and backward) are searched once
    "gpt_scan": (
        gpt,
        gpt.GPTConfig(
            hidden=128, heads=4, seq=64, vocab=512, layers=2, batch_size=16, scan_layers=True
        ),
    ),
}
MESHES = {
    "data8": {"data": 8},
    "data2xmodel4": {"data": 2, "model": 4},
    "data4xmodel2": {"data": 4, "model": 2},
    "data1xmodel8": {"data": 1, "model": 8},
}

# Every model on every mesh with the default engine, plus every explicit engine on the
# 2x4 mesh for the GPT. The GPTs on the 1-D meshes (8 and 1x8) are the slow tier: the
# 2-D meshes cover them and the smaller models run on every mesh.
# slow: the default run keeps each model on its 2-D meshes (data parallelism is in them too)
SLOW_CASES = {
    ("gpt", "data8"),
    ("gpt", "data1xmodel8"),
    ("gpt_scan", "data1xmodel8"),
    ("cnn", "data8"),
}
CASES = [
    pytest.param(
        model,
        mesh,
        "auto",
        id=f"{model}-{mesh}-auto",
        marks=[pytest.mark.slow] if (model, mesh) in SLOW_CASES else [],
    )
    for model in MODELS
    for mesh in MESHES
    if model != "gpt_scan" or mesh in ("data2xmodel4", "data1xmodel8")
] + [
    pytest.param("gpt", "data2xmodel4", engine, id=f"gpt-data2xmodel4-{engine}")
    for engine in ("recursive", "dp", "data", "fsdp")
]

# Parameters after an AdamW update are the one thing not compared at the default float32
# tolerance everywhere. Adam divides each gradient element by its own running RMS
# (+ eps = 1e-8), so it turns rounding noise into parameter changes of order lr:
# some parameters get no gradient at all in exact arithmetic, e.g. the attention key bias
# (softmax is shift-invariant) and the conv biases in front of batch norm (it subtracts
# the mean). Their computed gradients are pure rounding noise (|g| up to ~1e-7 measured),
# which any change of summation order changes (sharding, or just autopar re-emitting the
# program op by op so that XLA fuses it differently), and lr * g / (|g| + eps) then moves
# the parameter by anything in [-lr, lr]. The same holds for single elements whose gradient
# happens to be within a few eps of zero (see noise_level). So:
# * each step is checked from the reference state before it (no accumulated drift), and
#   parameter elements whose reference gradient at that step is below NOISE_FLOOR are only
#   checked to be within NOISE_ATOL (two opposite Adam updates); every other element, and
#   everything else in the state, at the default tolerance;
# * the free-running trajectory (the sharded state fed back) is checked on the losses and
#   Adam's moments, which those parameters do not influence (the loss does not depend on
#   them); its parameters and batch-norm running means (which add the conv bias) drift
#   apart by O(lr) in exactly those elements.
NOISE_FLOOR = 1e-6
NOISE_ATOL = 2.5 * LEARNING_RATE


@functools.cache
def model(name: str):
    module, config = MODELS[name]
    return module.make_train_step(config, learning_rate=LEARNING_RATE)


@functools.cache
def initial_state(name: str):
    return jax.jit(model(name).init)(0)


def grad_fn_for(name: str):
    """``grad(params, extra, batch)``: d loss / d params (``extra`` holds batch_stats)."""
    ts = model(name)

    def grads(params, extra, batch):
        return jax.grad(lambda p: ts.loss({**extra, "params": p}, batch))(params)

    grads.__name__ = f"{name}_grads"
    return grads


def split_state(state):
    extra = {k: v for k, v in state.items() if k == "batch_stats"}
    return state["params"], extra


def noise_level(g) -> np.ndarray:
    """Elements of one parameter's gradient that are rounding noise: all of them when the
    whole tensor is below NOISE_FLOOR (a parameter the loss does not depend on), else
    those strictly between 0 and NOISE_FLOOR. Exact zeros elsewhere (dead ReLU units,
    embedding rows not in the batch) are structural, exact in every program, and kept."""
    g = np.abs(np.asarray(g))
    if g.max(initial=0) < NOISE_FLOOR:
        return np.ones(g.shape, bool)
    return (g > 0) & (g < NOISE_FLOOR)


@functools.cache
def reference(name: str):
    """Single-device ``jax.jit`` results: losses, states after each step, the gradient at
    step 0, and per step the mask of parameter elements whose gradient at that step is at
    the noise floor (see NOISE_FLOOR)."""
    ts = model(name)
    losses, states = run_steps(
        jax.jit(ts.step), initial_state(name), ts.batch, STEPS, keep_states=True
    )
    grad = jax.jit(grad_fn_for(name))
    masks = []
    for i, before in enumerate([initial_state(name), *states[:-1]]):
        params, extra = split_state(before)
        g = grad(params, extra, ts.batch(i))
        masks.append(jax.tree_util.tree_map(noise_level, g))
        # The exception must stay an exception: the gradient-free biases and a few elements.
        leaves = jax.tree_util.tree_leaves(masks[-1])
        assert sum(m.sum() for m in leaves) <= 0.01 * sum(m.size for m in leaves), name
    params, extra = split_state(initial_state(name))
    return losses, states, grad(params, extra, ts.batch(0)), masks


def assert_states_close(actual, expected, noisy, what: str) -> None:
    """Default tolerances, except for parameter elements with noise-level gradients."""
    assert set(actual) == set(expected), what
    for key in expected:
        if key != "params":
            assert_trees_close(actual[key], expected[key], what=f"{what} {key}")
            continue
        keep = lambda x, m: np.where(m, 0, np.asarray(x))
        drop = lambda x, m: np.where(m, np.asarray(x), 0)
        a, e = actual[key], expected[key]
        assert_trees_close(
            jax.tree_util.tree_map(keep, a, noisy),
            jax.tree_util.tree_map(keep, e, noisy),
            what=f"{what} params",
        )
        assert_trees_close(
            jax.tree_util.tree_map(drop, a, noisy),
            jax.tree_util.tree_map(drop, e, noisy),
            atol=NOISE_ATOL,
            what=f"{what} params with noise-level gradients",
        )


def assert_on_mesh(outputs, out_specs, mesh, what: str) -> None:
    """Every output is spread over all 8 devices with the plan's per-device block shape."""
    leaves = jax.tree_util.tree_leaves(outputs)
    specs = spec_leaves(out_specs)
    assert len(leaves) == len(specs), what
    for i, (leaf, spec) in enumerate(zip(leaves, specs)):
        assert isinstance(leaf.sharding, NamedSharding), f"{what}: output {i} {leaf.sharding}"
        assert len(leaf.sharding.device_set) == 8, f"{what}: output {i} on {leaf.sharding}"
        want = shard_shape(leaf.shape, spec, mesh)
        assert leaf.addressable_shards[0].data.shape == want, (
            f"{what}: output {i} {leaf.shape} spec {spec}: shard "
            f"{leaf.addressable_shards[0].data.shape}, plan says {want}"
        )
        assert len(leaf.addressable_shards) == 8


def check_model(name: str, step, grad=None) -> autopar.Plan:
    """Run STEPS steps of ``step`` (and one ``grad``) and compare with ``reference(name)``."""
    ts = model(name)
    ref_losses, ref_states, ref_grads, noisy = reference(name)
    plan = step.plan(initial_state(name), ts.batch(0))
    what = f"{name} [{plan.engine}]"
    sharded = any(r.spec.used_axes for r in plan.inputs) or any(
        s.used_axes or s.partial for o in plan.ops for s in o.out_specs
    )
    assert sharded, f"{what}: nothing sharded\n{plan}"

    # Free-running: the sharded state is fed back, as in training.
    losses, states = run_steps(step, initial_state(name), ts.batch, STEPS, keep_states=True)
    for i in range(STEPS):
        assert_on_mesh((states[i], {"loss": losses[i]}), plan.out_specs, step.mesh, what)
        assert_trees_close(losses[i], ref_losses[i], what=f"{what} loss at step {i}")
        assert_trees_close(
            states[i]["opt_state"], ref_states[i]["opt_state"], what=f"{what} step {i} opt_state"
        )

    # Each step from the reference state before it: the whole updated state.
    for i, before in enumerate([initial_state(name), *ref_states[:-1]]):
        state, metrics = step(before, ts.batch(i))
        assert_trees_close(metrics["loss"], ref_losses[i], what=f"{what} loss at step {i}")
        assert_states_close(state, ref_states[i], noisy[i], f"{what} step {i}")

    if grad is None:
        return plan
    params, extra = split_state(initial_state(name))
    grads = grad(params, extra, ts.batch(0))
    gplan = grad.plan(params, extra, ts.batch(0))
    assert_on_mesh(grads, gplan.out_specs, grad.mesh, f"{name} grads")
    assert_trees_close(grads, ref_grads, what=f"{name} grads [{gplan.engine}]")
    return plan


@functools.cache
def parallel_step(name: str, mesh: str, engine: str, memory_budget: float | None = None):
    """Cached so that tests needing the same plan do not search and compile it twice."""
    return autopar.parallelize(
        model(name).step,
        mesh=MESHES[mesh],
        engine=engine,
        memory_budget=memory_budget,
        cluster=CLUSTER,
    )


@pytest.mark.parametrize(("name", "mesh", "engine"), CASES)
def test_sharded_equals_single_device(name, mesh, engine):
    step = parallel_step(name, mesh, engine)
    # Gradients once per model and mesh (compiling is what takes the time).
    grad = None
    if engine == "auto":
        grad = autopar.parallelize(
            grad_fn_for(name), mesh=MESHES[mesh], engine=engine, cluster=CLUSTER
        )
    plan = check_model(name, step, grad)
    if engine != "auto":
        assert plan.engine.split("+")[0] == engine, plan.engine


def test_memory_budget_forces_sharding():
    """A budget just above the fsdp plan's peak memory rules out the replicated plans, so
    the chosen plan must shard parameters, and must still compute the same numbers."""
    name, mesh = "gpt", "data2xmodel4"
    ts = model(name)
    args = (initial_state(name), ts.batch(0))
    # Just above what the fsdp plan takes once compiled: at this size XLA:CPU's own
    # buffers are a third on top of the cost model's figure, and the compile check in
    # `parallelize` holds plans to the compiled figure.
    from autopar.api import compiled_memory

    fsdp = parallel_step(name, mesh, "fsdp")
    budget = 1.05 * compiled_memory(fsdp.lower(*args).compile())
    step = parallel_step(name, mesh, "auto", budget)
    plan = step.plan(*args)
    assert plan.cost.peak_memory_bytes <= budget
    param_specs = spec_leaves(plan.in_specs[0]["params"])
    assert any(is_sharded(s) for s in param_specs), str(plan)
    # The replicated candidates do not fit, so something else was chosen.
    assert any(c.peak_memory_bytes > budget for c in plan.candidates.values())

    # For the gradient alone the fsdp plan is not the smallest one (its gathered
    # activations outweigh the parameters), so force sharded parameters with the engine.
    params, extra = split_state(initial_state(name))
    grad = autopar.parallelize(grad_fn_for(name), mesh=MESHES[mesh], engine="fsdp")
    gplan = grad.plan(params, extra, ts.batch(0))
    assert any(is_sharded(s) for s in spec_leaves(gplan.in_specs[0])), str(gplan)
    check_model(name, step, grad)


# ---------------------------------------------------------------------------------------
# Collectives: what the compiler emits vs what the plan predicts.
# ---------------------------------------------------------------------------------------


def _mlp_loss(w1, w2, x):
    return jnp.sum(jnp.tanh(x @ w1) @ w2)


def _mlp_value_and_grad(w1, w2, x):
    return jax.value_and_grad(_mlp_loss, argnums=(0, 1))(w1, w2, x)


COLLECTIVE_ARGS = (
    jax.ShapeDtypeStruct((1024, 4096), jnp.float32),
    jax.ShapeDtypeStruct((4096, 1024), jnp.float32),
    jax.ShapeDtypeStruct((256, 1024), jnp.float32),
)


def _normalize_kind(kind: str) -> str:
    # The CPU compiler emits all-reduce + dynamic-slice where GSPMD means reduce-scatter;
    # both carry the same (full-size) bytes, so count them as one kind (autopar/hlo.py).
    return "all-reduce" if kind == "reduce-scatter" else kind


def compiled_vs_predicted(fn, mesh, engine):
    step = autopar.parallelize(fn, mesh=mesh, engine=engine)
    plan = step.plan(*COLLECTIVE_ARGS)
    compiled = step.lower(*COLLECTIVE_ARGS).compile()
    found: dict[str, int] = {}
    for c in parse_collectives(compiled.as_text(), step.mesh):
        k = _normalize_kind(c.kind)
        found[k] = found.get(k, 0) + c.bytes
    predicted: dict[str, int] = {}
    for key, b in plan.cost.comm_bytes.items():
        if b:
            k = _normalize_kind(key.split("@")[0])
            predicted[k] = predicted.get(k, 0) + b
    return plan, found, predicted


ALL_TO_ALL_BYTES = (
    "autopar/cost.py CostModel.reshard prices an all-to-all at the bytes of the tensor with "
    "the moved axes already removed (`before` is built after `dims[i] = d[:keep]`), i.e. "
    "as if they were gathered: the fsdp/data plans predict all-to-all 1048576 B where the "
    "compiled program moves 131072 B per device (8x, the size of the moved axes)"
)


@pytest.mark.parametrize(
    "engine",
    ["auto", "fsdp"],
)
@pytest.mark.parametrize("fn", [_mlp_loss, _mlp_value_and_grad], ids=["forward", "value_and_grad"])
@pytest.mark.parametrize("mesh", ["data2xmodel4", "data8"])
def test_compiled_collectives_match_plan(mesh, fn, engine):
    plan, found, predicted = compiled_vs_predicted(fn, MESHES[mesh], engine)
    # The plan really shards the work (the matmuls), so there is communication to check.
    assert any(
        is_sharded(spec.to_pspec()) for op in plan.ops for spec in op.in_specs + op.out_specs
    ), str(plan)
    assert predicted, str(plan)
    assert set(found) == set(predicted), f"compiled {found} vs predicted {predicted}\n{plan}"
    for kind in predicted:
        assert found[kind] == pytest.approx(predicted[kind], rel=0.1), (
            f"{kind}: compiled {found[kind]} B vs predicted {predicted[kind]} B\n{plan}"
        )


def test_all_to_all_priced_at_the_per_device_buffer():
    """Moving an 8-way split from dim 0 to dim 1 exchanges each device's 1/8 block."""
    from autopar.cost.model import CostModel
    from autopar.ir.graph import TensorType
    from autopar.sharding import Spec, mesh_info

    step = autopar.parallelize(_mlp_loss, mesh={"data": 2, "model": 4})
    cost = CostModel(step.profile, mesh_info(step.mesh, step.profile.devices_per_node))
    t = TensorType((256, 1024), np.dtype(np.float32))
    src = Spec((("data", "model"), ()))
    dst = Spec(((), ("data", "model")))
    (coll,) = cost.reshard(t, src, dst).collectives
    assert coll.kind == "all-to-all"
    assert coll.bytes == 256 * 1024 * 4 // 8


def test_move_then_gather_reshard():
    """`S[data,model]R` to `RS[model]` moves `model` (all-to-all) and gathers `data`, as
    priced; told only the destination, XLA gathers over all 8 devices, then slices."""
    P = jax.sharding.PartitionSpec
    mesh = make_mesh({"data": 2, "model": 4})

    def f(x):
        y = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "model")))
        return jnp.cos(y) * 2.0

    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 100.0
    step = autopar.parallelize(f, mesh=mesh, cluster=CLUSTER, in_specs=(P(("data", "model")),))
    np.testing.assert_allclose(step(x), jax.jit(f)(x), rtol=1e-6)
    found = {
        (c.kind, c.axes) for c in parse_collectives(step.lower(x).compile().as_text(), step.mesh)
    }
    assert ("all-gather", ("data", "model")) not in found, found
    assert ("all-to-all", ("model",)) in found and ("all-gather", ("data",)) in found, found


def test_moves_out_of_several_dims_go_one_axis_at_a_time():
    """`S[model]S[data]R` to `RRS[stage,data,model]`: told only the destination, XLA
    gathers the whole value ("involuntary full rematerialization"); the lowering slices
    `stage`, then moves `data`, then `model`, each an all-to-all of 1/8 blocks, as
    priced. (A 1F1B pipeline's activations took such a reshard after the loop.)"""
    from autopar.cost.model import CostModel
    from autopar.ir.graph import TensorType
    from autopar.sharding import Spec, mesh_info

    P = jax.sharding.PartitionSpec
    mesh = make_mesh({"stage": 2, "data": 2, "model": 2})
    want = P(None, None, ("stage", "data", "model"))

    def f(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, want))

    x = jnp.arange(16 * 8 * 32, dtype=jnp.float32).reshape(16, 8, 32) / 100.0
    step = autopar.parallelize(f, mesh=mesh, cluster=CLUSTER, in_specs=(P("model", "data"),))
    np.testing.assert_allclose(step(x), jax.jit(f)(x), rtol=1e-6)
    found = [
        (c.kind, c.axes) for c in parse_collectives(step.lower(x).compile().as_text(), step.mesh)
    ]
    # there and back (the output keeps the argument's layout): the way back moves
    # `model`, then `data`, and gathers `stage`
    assert sorted(found) == sorted(
        [("all-to-all", ("data",)), ("all-to-all", ("model",))] * 2 + [("all-gather", ("stage",))]
    ), found

    cost = CostModel(step.profile, mesh_info(step.mesh, step.profile.devices_per_node))
    src, dst = Spec((("model",), ("data",), ())), Spec.from_pspec(want, 3)
    assert [str(s) for s in src.move_steps(dst)] == [
        "S[model]S[data]S[stage]",
        "S[model]RS[stage,data]",
        "RRS[stage,data,model]",
    ]
    priced = cost.reshard(TensorType((16, 8, 32), np.dtype(np.float32)), src, dst).collectives
    assert [(c.kind, c.axes, c.bytes) for c in priced] == [
        ("all-to-all", ("data",), 16 * 8 * 32 * 4 // 8),
        ("all-to-all", ("model",), 16 * 8 * 32 * 4 // 8),
    ]
    # an axis that is not minor-most where it leaves: XLA moves both at once
    assert Spec((("data", "model"), ())).move_steps(Spec(((), ("data", "model")))) is None


def test_position_dependent_batches():
    """Guard: the batches really differ per step, else the steps would not test much."""
    for name in MODELS:
        ts = model(name)
        a, b = jax.tree_util.tree_leaves(ts.batch(0)), jax.tree_util.tree_leaves(ts.batch(1))
        assert any(not np.array_equal(x, y) for x, y in zip(a, b)), name
