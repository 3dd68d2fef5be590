"""Bad or unusual input: the catalogue of docs/troubleshooting.md, one test per entry.

Each entry either gives correct numbers (the sharded program equals `jax.jit`) or a
clear autopar error that names the user's code, the shapes and what to do.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, run_steps
from jax.sharding import NamedSharding, PartitionSpec

import autopar
from autopar.examples.models import mlp

MESH = {"data": 2, "model": 4}
HERE = Path(__file__).name


def _values(shape, dtype=jnp.float32, mod: int = 11):
    """Position-dependent values in about [-0.5, 0.5] (exact in every float type)."""
    n = math.prod(shape)
    v = (np.arange(n) * 7 + 3) % mod - mod // 2
    v = v.reshape(shape)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(v / (2 * mod), dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(v > 0)
    return jnp.asarray(np.abs(v), dtype)


def _tanh_matmul(w, x):
    return jnp.tanh(x @ w)


def _assert_plan_divides(plan):
    """Every sharded dim of every argument and result is divisible by its axes."""
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
    for r in plan.inputs + plan.outputs:
        for dim, axes in zip(r.shape, r.spec.dims):
            n = math.prod(sizes[a] for a in axes)
            assert dim % n == 0, f"{r.path} {list(r.shape)} sharded {r.spec}"


def _sharded_somewhere(plan) -> bool:
    return any(any(d for d in s.dims) for o in plan.ops for s in o.out_specs)


def _line_of(fn, offset: int = 1) -> str:
    return f"{HERE}:{fn.__code__.co_firstlineno + offset}"


# ---- 1. dimensions no mesh axis divides -------------------------------------------------


@pytest.mark.parametrize("mesh", [{"data": 8}, MESH], ids=["8", "2x4"])
def test_batch_no_axis_divides(mesh):
    """Batch 7 on 8 devices: strategies that would split 7 are excluded; the other
    dims still shard, and the numbers are right."""
    w, x = _values((256, 512)), _values((7, 256))
    step = autopar.parallelize(_tanh_matmul, mesh=mesh)
    plan = step.plan(w, x)
    _assert_plan_divides(plan)
    assert _sharded_somewhere(plan), str(plan)  # the 512 dim still shards
    out = step(w, x)
    assert_trees_close(out, jax.jit(_tanh_matmul)(w, x))
    assert out.shape == (7, 512)


def test_the_data_engine_with_a_batch_no_axis_divides_says_it_runs_replicated():
    """engine="data" on a conv with batch 12 over 8 devices splits nothing: it warns,
    where it said so only in the summary's `work:` line."""

    def conv(w, x):
        dims = ("NHWC", "HWIO", "NHWC")
        return jnp.tanh(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims))

    w, x = _values((3, 3, 16, 16)), _values((12, 8, 8, 16))
    step = autopar.parallelize(conv, mesh={"data": 8}, engine="data")
    with pytest.warns(UserWarning, match=r"engine='data' found no batch dim .* 100% of"):
        plan = step.plan(w, x)
    assert any(w.startswith("engine='data' found no batch dim") for w in plan.warnings)
    assert_trees_close(step(w, x), jax.jit(conv)(w, x))


def test_no_dim_divides_runs_replicated():
    """Nothing divides by 8: the step runs whole on every device, and says so (a
    `UserWarning` and the plan's one warning)."""
    w, x = _values((9, 5)), _values((7, 9))
    step = autopar.parallelize(_tanh_matmul, mesh={"data": 8})
    with pytest.warns(UserWarning, match="can be split on the mesh data=8"):
        plan = step.plan(w, x)
    assert not _sharded_somewhere(plan)
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("nothing in _tanh_matmul")
    assert_trees_close(step(w, x), jax.jit(_tanh_matmul)(w, x))


def _mean_matmul(w, x):
    return jnp.mean(x @ w)


def test_nothing_divides_though_sums_could_stay_pending():
    """A sum's strategies include pending sums of whole values (`+P[data]`), which split
    nothing: a step nothing divides by 7 still warns that it runs whole everywhere."""
    w, x = _values((9, 5)), _values((10, 9))
    step = autopar.parallelize(_mean_matmul, mesh={"data": 7}, progress=False)
    with pytest.warns(UserWarning, match="can be split on the mesh data=7"):
        plan = step.plan(w, x)
    assert not _sharded_somewhere(plan)
    assert_trees_close(step(w, x), jax.jit(_mean_matmul)(w, x))


def test_a_mesh_of_fewer_devices_says_the_rest_stay_idle():
    """A mesh of 4 of the 8 devices runs on the first 4, as `jax.make_mesh` would, and
    says so; a mesh of all 8 says nothing of the kind."""
    w, x = _values((64, 32)), _values((16, 64))
    with pytest.warns(UserWarning, match="takes 4 of the 8 devices here .*leaving 4 idle"):
        step = autopar.parallelize(_tanh_matmul, mesh={"data": 2, "model": 2}, progress=False)
    assert len(step(w, x).sharding.device_set) == 4
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*idle")
        autopar.parallelize(_tanh_matmul, mesh=8, progress=False)
        autopar.parallelize(_tanh_matmul, mesh={"data": 16}, progress=False)  # offline


def test_train_step_with_odd_batch():
    ts = mlp.make_train_step(mlp.MLPConfig(batch_size=7))
    state = jax.jit(ts.init)(0)
    step = autopar.parallelize(ts.step, mesh=MESH)
    _assert_plan_divides(step.plan(state, ts.batch(0)))
    losses, final = run_steps(step, state, ts.batch, 2)
    ref_losses, ref = run_steps(jax.jit(ts.step), state, ts.batch, 2)
    assert_trees_close(losses, ref_losses)
    assert_trees_close(final, ref)


# ---- 2. prime device counts -------------------------------------------------------------


@pytest.mark.parametrize("mesh", [{"data": 7}, 7], ids=["dict", "count"])
def test_prime_device_count(mesh):
    """7 of the 8 devices: batch 14 splits 7 ways; 512 does not, so it stays whole."""
    w, x = _values((256, 512)), _values((14, 256))
    step = autopar.parallelize(_tanh_matmul, mesh=mesh)
    plan = step.plan(w, x)
    assert plan.mesh.shape == {"data": 7}
    _assert_plan_divides(plan)
    out = step(w, x)
    assert len(out.sharding.device_set) == 7
    assert_trees_close(out, jax.jit(_tanh_matmul)(w, x))


def test_prime_mesh_with_nothing_divisible():
    w, x = _values((64, 32)), _values((16, 64))
    step = autopar.parallelize(_tanh_matmul, mesh={"data": 5})
    assert not _sharded_somewhere(step.plan(w, x))
    assert_trees_close(step(w, x), jax.jit(_tanh_matmul)(w, x))


# ---- 3. a mesh larger than the devices --------------------------------------------------


@pytest.mark.parametrize("mesh, need", [({"data": 16}, 16), ({"data": 4, "model": 4}, 16), (9, 9)])
def test_mesh_larger_than_devices(mesh, need):
    w, x = _values((64, 32)), _values((16, 64))
    step = autopar.parallelize(_tanh_matmul, mesh=mesh)
    step.plan(w, x)  # planning offline works
    with pytest.raises(autopar.MeshError) as e:
        step(w, x)
    msg = str(e.value)
    assert f"needs {need} devices but only 8 are available" in msg
    assert "_tanh_matmul" in msg and "xla_force_host_platform_device_count" in msg


@pytest.mark.parametrize(
    "mesh, match",
    [
        ({"data": 0}, "size must be a positive int, got 0"),
        ({"data": 2.0}, "size must be a positive int, got 2.0"),
        ([2, 4], "mesh must be a dict of axis sizes"),
        ("data=2,model=4", "the only string accepted is 'auto'"),
        (0, "a device count must be >= 1"),
    ],
)
def test_malformed_mesh(mesh, match):
    with pytest.raises(autopar.MeshError, match=match):
        autopar.parallelize(_tanh_matmul, mesh=mesh)


# ---- 4. contradictory user constraints --------------------------------------------------


def _two_constraints(w, x):
    y = x @ w
    a = jax.lax.with_sharding_constraint(y, PartitionSpec("data", None))
    b = jax.lax.with_sharding_constraint(y, PartitionSpec(None, "model"))
    c = jax.lax.with_sharding_constraint(b, PartitionSpec("model", "data"))  # and back
    return jnp.tanh(a) + 2 * b - c


def test_contradictory_constraints_stay_correct():
    w, x = _values((64, 32)), _values((16, 64))
    step = autopar.parallelize(_two_constraints, mesh=MESH)
    plan = step.plan(w, x)
    fixed = [o for o in plan.ops if o.op == "sharding_constraint"]
    assert len(fixed) == 3 and len({str(o.out_specs) for o in fixed}) == 3
    with jax.set_mesh(step.mesh):
        ref = jax.jit(_two_constraints)(w, x)
    assert_trees_close(step(w, x), ref)


def _constrain_output(w, x):
    return jax.lax.with_sharding_constraint(x[:6] @ w, PartitionSpec("model", None))


def test_indivisible_constraint_on_a_result():
    w, x = _values((64, 32)), _values((16, 64))
    step = autopar.parallelize(_constrain_output, mesh=MESH)
    with jax.set_mesh(step.mesh):
        ref = jax.jit(_constrain_output)(w, x)  # jax.jit pads the uneven constraint
    try:
        out = step(w, x)
    except autopar.AutoparError as e:  # or a clear error naming the constraint is fine too
        assert _line_of(_constrain_output) in str(e) and "[6, 32]" in str(e)
    else:
        assert_trees_close(out, ref)


def test_indivisible_constraint_inside_is_kept():
    def f(w, x):
        return 2 * jnp.tanh(_constrain_output(w, x))

    w, x = _values((64, 32)), _values((16, 64))
    step = autopar.parallelize(f, mesh=MESH)
    _assert_plan_divides(step.plan(w, x))
    assert_trees_close(step(w, x), 2 * jnp.tanh(x[:6] @ w))


def test_constraint_on_an_axis_the_mesh_lacks():
    def f(w, x):
        return jax.lax.with_sharding_constraint(x @ w, PartitionSpec("batch"))

    with pytest.raises(autopar.CaptureError) as e:
        autopar.parallelize(f, mesh=MESH).plan(_values((64, 32)), _values((16, 64)))
    msg = str(e.value)
    assert "axis: batch" in msg and "('data', 'model')" in msg and "float32[16, 64]" in msg


def test_constraint_on_another_mesh_names_the_line():
    other = autopar.make_mesh({"x": 8})

    def f(w, x):
        return jax.lax.with_sharding_constraint(x @ w, NamedSharding(other, PartitionSpec("x")))

    with pytest.raises(autopar.AutoparError) as e:
        autopar.parallelize(f, mesh=MESH).plan(_values((64, 32)), _values((16, 64)))
    assert _line_of(f) in str(e.value) and "'x'" in str(e.value)


# ---- 5. a memory budget nothing fits ----------------------------------------------------


def test_memory_budget_nothing_fits():
    ts = mlp.make_train_step(mlp.MLPConfig(hidden=256))
    state, batch = jax.eval_shape(lambda: (ts.init(0), ts.batch(0)))
    step = autopar.parallelize(ts.step, mesh=MESH, memory_budget=4096)
    with pytest.raises(autopar.MemoryBudgetError) as e:
        step.plan(state, batch)
    msg = str(e.value)
    assert "no plan fits the memory budget of 4.0 KiB per device" in msg
    assert "the smallest found" in msg and "needs" in msg
    # the dominant tensors are named by path, with shape and bytes per device
    assert "Largest arguments per device: state/" in msg and "float32[256,256]" in msg
    assert "Raise memory_budget" in msg
    # the options that cut memory and were not used, named as what to try; not
    # precision='bf16', which keeps activations and weights float32 (it casts the
    # matmuls' operands: no smaller peak)
    assert "or try remat='auto'" in msg and "precision='bf16'" not in msg, msg
    assert "grad_accumulation=M" in msg and "pipeline_stages=S" in msg, msg
    with pytest.raises(autopar.MemoryBudgetError) as e:
        autopar.parallelize(ts.step, mesh=MESH, memory_budget=4096, remat="full").plan(state, batch)
    assert "remat='auto'" not in str(e.value) and "grad_accumulation=M" in str(e.value)


def _outer(x):
    big = x[:, :, None] * x[:, None, :]  # float32[64, 256, 256]: 16 MiB, the whole peak
    return jnp.tanh(big).sum()


def test_memory_error_names_the_dominant_intermediate():
    with pytest.raises(autopar.MemoryBudgetError) as e:
        autopar.parallelize(_outer, mesh={"data": 8}, memory_budget=65536).plan(
            jax.ShapeDtypeStruct((64, 256), jnp.float32)
        )
    msg = str(e.value)
    assert _line_of(_outer) in msg or "[64,256,256]" in msg.replace(" ", ""), msg


# ---- 6. unsupported primitives ----------------------------------------------------------


def _cholesky(a):
    return jax.lax.linalg.cholesky(a @ a.T + 8 * jnp.eye(8))


def _eigh(a):
    return jnp.linalg.eigh(a @ a.T)[0]


def test_unsupported_primitive_runs_replicated_with_its_line():
    a = _values((8, 8))
    step = autopar.parallelize(_cholesky, mesh=MESH)
    with pytest.warns(UserWarning, match="no sharding rule for primitive 'cholesky'") as caught:
        assert_trees_close(step(a), jax.jit(_cholesky)(a))
    assert _line_of(_cholesky) in str(caught[0].message)  # a Python warning, not only the plan
    # raised deep in autopar, it points at the user's call (`errors.user_level`)
    assert caught[0].filename == __file__, (caught[0].filename, caught[0].lineno)
    (warning,) = step.plan(a).warnings
    assert f"no sharding rule for primitive 'cholesky' at {_line_of(_cholesky)}" in warning
    assert "runs replicated" in warning


def test_a_wrapped_function_is_named_where_its_own_code_is():
    """`parallelize(jax.grad(f))`: the plan names `f` at its line, not JAX's wrapper."""

    def f(a):
        return jnp.sum(jnp.tanh(a) ** 2)

    plan = autopar.parallelize(jax.grad(f), mesh=MESH).plan(_values((8, 8)))
    assert f"f ({_line_of(f, 0)})" in plan.summary(), plan.summary().splitlines()[0]


def test_unsupported_primitive_inside_a_library_jit_names_the_callers_line():
    a = _values((8, 8))
    step = autopar.parallelize(_eigh, mesh=MESH)
    assert_trees_close(step(a), jax.jit(_eigh)(a), rtol=1e-4, atol=1e-5)
    (warning,) = step.plan(a).warnings
    assert _line_of(_eigh) in warning, warning


# ---- 7. while / cond / scan -------------------------------------------------------------


def _loops(w, x):
    def body(c):
        i, y = c
        return i + 1, jnp.tanh(y @ w)

    _, y = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
    y = jax.lax.cond(y.sum() > 0, lambda y: y * 2, lambda y: -y, y)
    z, sums = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), c.sum()), y, None, length=2)
    return z, sums


def test_control_flow_correct_with_warnings():
    w, x = _values((64, 64)), _values((16, 64))
    step = autopar.parallelize(_loops, mesh=MESH)
    assert_trees_close(step(w, x), jax.jit(_loops)(w, x))
    warnings = "\n".join(step.plan(w, x).warnings)
    assert f"control flow 'while' at {_line_of(_loops, 5)} runs replicated" in warnings
    # scan bodies and cond branches are searched, not run replicated (tests/test_cond.py)
    assert "'scan'" not in warnings and "'cond'" not in warnings


# ---- 8. static arguments ----------------------------------------------------------------


def _layers(w, x, n, act):
    for _ in range(n):
        x = act(x @ w)
    return x


def test_static_arguments():
    w, x = _values((64, 64)), _values((16, 64))
    step = autopar.parallelize(_layers, mesh=MESH, static_argnums=(2, 3))
    ref = jax.jit(_layers, static_argnums=(2, 3))
    for n, act in ((2, jnp.tanh), (3, jax.nn.relu), (2, jnp.tanh)):
        assert_trees_close(step(w, x, n, act), ref(w, x, n, act))
    assert len(step._cache) == 2
    assert [r.path for r in step.plan(w, x, 2, jnp.tanh).inputs] == ["w", "x"]


def test_forgotten_static_argument_says_what_to_do():
    w, x = _values((64, 64)), _values((16, 64))
    with pytest.raises(autopar.CaptureError) as e:
        autopar.parallelize(_layers, mesh=MESH)(w, x, 2, jnp.tanh)
    msg = str(e.value)
    assert f"could not trace _layers ({_line_of(_layers, 0)})" in msg
    assert "float32[64, 64], float32[16, 64]" in msg and "static_argnums" in msg


# ---- 9. non-array leaves ----------------------------------------------------------------


def _scaled(params, x, lr, flag):
    y = jnp.tanh(x @ params["w"]) * params["scale"] + params["n"]
    return y * lr if flag else y


def test_python_scalars_in_arguments():
    w, x = _values((64, 32)), _values((16, 64))
    step = autopar.parallelize(_scaled, mesh=MESH, static_argnums=3)
    ref = jax.jit(_scaled, static_argnums=3)
    for scale, n, lr in ((0.5, 2, 0.1), (0.25, 3, 0.2)):
        params = {"w": w, "scale": scale, "n": n}
        assert_trees_close(step(params, x, lr, True), ref(params, x, lr, True))
    assert len(step._cache) == 1  # new Python values do not re-search, as with jax.jit
    dtypes = [r.dtype for r in step.plan({"w": w, "scale": 0.5, "n": 2}, x, 0.1, True).inputs]
    assert dtypes == ["int32", "float32", "float32", "float32", "float32"]  # n scale w x lr


def test_numpy_and_none_leaves():
    def f(x, extra, n):
        return x.sum(0) * n if extra is None else x

    x = np.arange(128, dtype=np.float64).reshape(16, 8) / 7  # float64 -> float32, as jit
    step = autopar.parallelize(f, mesh=MESH)
    assert_trees_close(step(x, None, np.int64(3)), jax.jit(f)(x, None, np.int64(3)))


def test_string_leaf_says_use_static_argnums():
    with pytest.raises(autopar.CaptureError, match="str.*static_argnums"):
        autopar.parallelize(lambda x, mode: x * 2, mesh=MESH)(jnp.arange(8.0), "train")


def test_python_values_in_results():
    def f(x):
        return {"loss": x.sum(), "step": 1, "lr": 0.5, "nothing": None}

    x = _values((16, 8))
    assert_trees_close(autopar.parallelize(f, mesh=MESH)(x), jax.jit(f)(x))


def test_keyword_arguments():
    w, x = _values((64, 32)), _values((16, 64))
    step = autopar.parallelize(_tanh_matmul, mesh=MESH)
    assert_trees_close(step(w, x=x), jax.jit(_tanh_matmul)(w, x=x))


def _keyword_scaled(w, x, n, *, scale, bias=None, **rest):
    y = jnp.tanh(x @ w) * scale
    return (y if bias is None else y + bias) ** n


def test_keyword_only_arguments():
    """Keyword-only parameters are traced after the positional ones, under their names;
    argnums count positional parameters only, as in jax.jit."""
    w, x, b, s = _values((64, 32)), _values((16, 64)), _values((32,)), jnp.float32(0.5)
    step = autopar.parallelize(_keyword_scaled, mesh=MESH, static_argnums=-1)
    ref = jax.jit(_keyword_scaled, static_argnums=2)
    assert_trees_close(step(w, x, 2, scale=s), ref(w, x, 2, scale=s))
    assert_trees_close(step(w, x=x, n=3, bias=b, scale=s), ref(w, x, 3, scale=s, bias=b))
    plan = step.plan(w, x, 3, scale=s, bias=b)
    assert [r.path for r in plan.inputs] == ["w", "x", "scale", "bias"]
    with pytest.raises(autopar.AutoparError, match="missing a required argument: 'scale'"):
        step(w, x, 2)
    # in_specs naming the positional arguments leaves the keyword-only ones to the search
    pinned = autopar.parallelize(
        _keyword_scaled, mesh=MESH, static_argnums=2, in_specs=(PartitionSpec(None, "model"), None)
    )
    assert_trees_close(pinned(w, x, 2, scale=s), ref(w, x, 2, scale=s))
    assert pinned.plan(w, x, 2, scale=s).inputs[0].spec.to_pspec() == PartitionSpec(None, "model")
    # **kwargs entries are traced under their names, as jax.jit does (model.apply's train=)
    assert_trees_close(step(w, x, 2, scale=s, other=b), ref(w, x, 2, scale=s, other=b))


# ---- 10. integer, bool and low-precision dtypes ------------------------------------------


def _int_program(w, x):
    y = x @ w
    return y, (y * 2).sum(0), jnp.max(x, axis=1), (x > 1).sum()


def _bool_program(w, x):
    return (x[:, :, None] & w[None]).any(1), jnp.logical_or(x, ~x).all(0), x.sum()


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_integer_and_bool_dtypes_exact(dtype):
    fn = _bool_program if dtype == jnp.bool_ else _int_program
    w, x = _values((64, 128), dtype, mod=5), _values((16, 64), dtype, mod=5)
    step = autopar.parallelize(fn, mesh=MESH)
    out = step(w, x)
    assert_trees_close(out, jax.jit(fn)(w, x))  # integers compare exactly


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_floats(dtype):
    def fn(w, x):
        y = jnp.tanh(x @ w)
        return y, y.astype(jnp.float32).sum(0), jnp.exp(y).max()

    w, x = _values((256, 512), dtype), _values((16, 256), dtype)
    step = autopar.parallelize(fn, mesh=MESH)
    assert _sharded_somewhere(step.plan(w, x))
    out = step(w, x)
    assert [o.dtype for o in out] == [dtype, jnp.float32, dtype]
    assert_trees_close(out, jax.jit(fn)(w, x), rtol=2e-2, atol=2e-2)


# ---- 11. zero-size arrays ---------------------------------------------------------------


@pytest.mark.parametrize(
    "w_shape, x_shape", [((64, 32), (0, 64)), ((64, 0), (16, 64)), ((0, 32), (16, 0))]
)
def test_zero_size_arrays(w_shape, x_shape):
    def fn(w, x):
        return jnp.tanh(x @ w), (x @ w).sum(), x.sum(0)

    w, x = jnp.zeros(w_shape), jnp.zeros(x_shape) + 1
    out = autopar.parallelize(fn, mesh=MESH)(w, x)
    assert_trees_close(out, jax.jit(fn)(w, x))


# ---- 12. donated buffers reused ---------------------------------------------------------

_DONATE_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, autopar

def step(state, x):
    return {"w": state["w"] * 2.0 + x.sum()}, x.mean()

state = {"w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 100}
x = jnp.arange(16.0)
fn = autopar.parallelize(step, mesh={"data": 2, "model": 4}, donate_argnums=0)
placed = jax.device_put(jax.tree.map(jnp.copy, state), fn.plan(state, x).in_shardings[0])
new_state, _ = fn(placed, x)
assert placed["w"].is_deleted()
try:
    fn(placed, x)  # the donated state again, instead of new_state
except Exception as e:
    print("ERROR", type(e).__name__, e, flush=True)
"""


def test_reusing_a_donated_argument_is_a_clear_error():
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_DONATE_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"exit {r.returncode} (-11 = segfault): {r.stderr[-2000:]}"
    assert "ERROR" in r.stdout and "state/w" in r.stdout and "donat" in r.stdout, r.stdout


def test_in_specs_mistakes_say_what_is_wrong():
    """`in_specs` as a list (as jax.jit takes in_shardings) pins as a tuple does; one
    entry too few, an axis named twice and an unknown cluster each say so (they read as
    JAX's tree-prefix internals, a divisibility problem and a bare ValueError)."""
    from autopar.errors import AutoparError, MeshError

    def f(x, y):
        return (x * y).sum()

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    mesh = {"data": 2, "model": 4}
    P = PartitionSpec
    plan = autopar.parallelize(f, mesh=mesh, in_specs=[P("data"), None]).plan(x, x)
    assert plan.in_specs[0] == P("data", None)
    with pytest.raises(MeshError, match="in_specs has 1 entries but the function takes 2"):
        autopar.parallelize(f, mesh=mesh, in_specs=(P("data"),)).plan(x, x)
    with pytest.raises(MeshError, match="names mesh axis 'data' more than once"):
        autopar.parallelize(f, mesh=mesh, in_specs=(P(("data", "data")), None)).plan(x, x)
    with pytest.raises(AutoparError, match="did you mean 'h100-sxm'") as e:
        autopar.parallelize(f, mesh=mesh, cluster="h100-sxn")
    assert "troubleshooting" in str(e.value)
