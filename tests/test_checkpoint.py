"""Checkpoints across plans: a state saved under one plan restores onto another plan's
shardings and training continues as if uninterrupted; interrupted saves are harmless."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_close, run_steps
from jax.sharding import NamedSharding, PartitionSpec

import autopar
import autopar.checkpoint as ckpt
from autopar.examples.models import mlp

CONFIG = mlp.MLPConfig()
PLAN_A = {"mesh": {"data": 2, "model": 4}, "engine": "dp"}
PLAN_B = {"mesh": {"data": 8}, "engine": "fsdp"}


@pytest.fixture(scope="module")
def ts():
    return mlp.make_train_step(CONFIG)


@pytest.fixture(scope="module")
def abstract(ts):
    return jax.eval_shape(lambda: (ts.init(0), ts.batch(0)))


@pytest.fixture(scope="module")
def step_a(ts):
    return autopar.parallelize(ts.step, **PLAN_A)


@pytest.fixture(scope="module")
def step_b(ts):
    return autopar.parallelize(ts.step, **PLAN_B)


@pytest.fixture(scope="module")
def after_two_on_a(ts, step_a):
    state = jax.jit(ts.init)(0)
    losses, state = run_steps(step_a, state, ts.batch, 2)
    return losses, state


def _specs(tree):
    return [x.sharding.spec for x in jax.tree_util.tree_leaves(tree)]


def test_resume_under_another_plan_equals_uninterrupted(
    ts, abstract, step_a, step_b, after_two_on_a, tmp_path
):
    losses_a, state_a = after_two_on_a
    assert ckpt.save(tmp_path, state_a, step=2) == 2

    # The one-liner: restore straight into plan B's layout for the state.
    plan_b = step_b.plan(*abstract)
    restored = ckpt.restore(tmp_path, plan_b)
    assert _specs(restored) == jax.tree_util.tree_leaves(
        plan_b.in_specs[0], is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    assert _specs(restored) != _specs(state_a)  # really another layout
    assert restored["params"]["dense_0"]["kernel"].sharding.mesh.shape == {"data": 8}
    assert_trees_close(restored, state_a, rtol=0, atol=0, what="restored")

    batch = lambda i: ts.batch(i + 2)
    losses_b, resumed = run_steps(step_b, restored, batch, 2)

    # Nothing lost: bit-identical to handing plan A's live state to plan B.
    direct_losses, direct = run_steps(step_b, state_a, batch, 2)
    assert_trees_close(resumed, direct, rtol=0, atol=0, what="resumed vs no checkpoint")
    np.testing.assert_array_equal(losses_b, direct_losses)

    # And the same as 4 uninterrupted single-device steps.
    ref_losses, ref = run_steps(jax.jit(ts.step), jax.jit(ts.init)(0), ts.batch, 4)
    np.testing.assert_allclose(losses_a + losses_b, ref_losses, rtol=1e-5)
    assert_trees_close(resumed, ref, what="resumed vs single device")


def test_restore_forms(ts, abstract, step_b, after_two_on_a, tmp_path):
    _, state = after_two_on_a
    ckpt.save(tmp_path, state)
    plan = step_b.plan(*abstract)
    # explicit shardings, as documented in the README one-liner
    a = ckpt.restore(tmp_path, plan.in_shardings[0])
    # abstract_state (keeps namedtuples) + one sharding for every leaf
    mesh = autopar.make_mesh({"data": 8})
    rep = NamedSharding(mesh, PartitionSpec())
    b = ckpt.restore(tmp_path, rep, abstract[0])
    assert all(x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(b))
    # abstract_state carrying its own shardings
    c = ckpt.restore(
        tmp_path,
        abstract_state=jax.tree_util.tree_map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            abstract[0],
            plan.in_shardings[0],
        ),
    )
    for got in (a, b, c):
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(state)
        assert_trees_close(got, state, rtol=0, atol=0)


def test_steps_are_numbered_and_kept(tmp_path):
    mesh = autopar.make_mesh({"data": 8})
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, PartitionSpec("data")))
    assert ckpt.latest_step(tmp_path / "none") is None
    for want in range(3):
        assert ckpt.save(tmp_path, {"x": x + want}, max_to_keep=2) == want
    assert ckpt.all_steps(tmp_path) == [1, 2]
    got = ckpt.restore(tmp_path, {"x": x.sharding})
    np.testing.assert_array_equal(got["x"], np.arange(16.0) + 2)
    got = ckpt.restore(tmp_path, {"x": x.sharding}, step=1)
    np.testing.assert_array_equal(got["x"], np.arange(16.0) + 1)
    with pytest.raises(ckpt.CheckpointError, match="already has step 2"):
        ckpt.save(tmp_path, {"x": x}, step=2)
    with pytest.raises(ckpt.CheckpointError, match=r"no step 0; committed steps: \[1, 2\]"):
        ckpt.restore(tmp_path, {"x": x.sharding}, step=0)


def _fail_mid_write(monkeypatch, where: str):
    """Make the next save raise after Orbax started writing the step."""
    if where == "arrays":  # array writes started, then the process dies
        real = ocp.type_handlers.ArrayHandler.serialize

        async def serialize(self, values, infos, args=None):
            for f in await real(self, values, infos, args):
                f.result()  # these arrays are on disk (in the step's temporary directory)
            raise OSError("simulated crash while writing arrays")

        monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "serialize", serialize)
    else:  # every byte written, dies before the commit (the rename)
        cls = ocp.path.atomicity.AtomicRenameTemporaryPath

        async def finalize(self, *args, **kwargs):
            raise OSError("simulated crash before the commit")

        monkeypatch.setattr(cls, "finalize", finalize)


@pytest.mark.parametrize("where", ["arrays", "commit"])
def test_interrupted_save_keeps_the_previous_step(where, tmp_path, monkeypatch):
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    sh = NamedSharding(mesh, PartitionSpec("data", "model"))
    good = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), sh)}
    ckpt.save(tmp_path, good, step=1)
    with monkeypatch.context() as m:
        _fail_mid_write(m, where)
        with pytest.raises(OSError, match="simulated crash"):
            ckpt.save(tmp_path, {"w": good["w"] * -1}, step=2)
    # The half-written step is on disk, in Orbax's temporary directory, with data in it ...
    (partial,) = [p for p in tmp_path.iterdir() if p.name != "1"]
    assert partial.name.startswith("2.") and "tmp" in partial.name
    assert len(list(partial.rglob("*"))) > 3
    # ... and is neither listed nor restored.
    assert ckpt.all_steps(tmp_path) == [1]
    got = ckpt.restore(tmp_path, {"w": sh})
    np.testing.assert_array_equal(got["w"], np.arange(64.0).reshape(8, 8))
    # and saving that step again afterwards works
    ckpt.save(tmp_path, {"w": good["w"] * -1}, step=2)
    assert ckpt.latest_step(tmp_path) == 2


def test_restore_errors_name_the_problem(tmp_path):
    mesh = autopar.make_mesh({"data": 8})
    sh = NamedSharding(mesh, PartitionSpec("data"))
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in .*does not exist"):
        ckpt.restore(tmp_path / "missing", {"w": sh})
    ckpt.save(tmp_path, {"w": jnp.arange(16.0), "b": jnp.zeros(3)})
    with pytest.raises(ckpt.CheckpointError, match="missing v; it has instead b, w"):
        ckpt.restore(tmp_path, {"v": sh})
    with pytest.raises(ckpt.CheckpointError, match=r"w was saved as float32\[16\].*float32\[8\]"):
        ckpt.restore(tmp_path, sh, {"w": jax.ShapeDtypeStruct((8,), jnp.float32)})
    with pytest.raises(ckpt.CheckpointError, match=r"b \[3\] cannot be laid out"):
        ckpt.restore(tmp_path, {"w": sh, "b": sh})
    with pytest.raises(ckpt.CheckpointError, match="say where the arrays go"):
        ckpt.restore(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="say where the arrays go"):
        ckpt.restore(tmp_path, sh)  # one sharding, but no structure
    abstract = {
        "w": jax.ShapeDtypeStruct((16,), jnp.float32),
        "b": jax.ShapeDtypeStruct((3,), jnp.float32),
    }
    with pytest.raises(ckpt.CheckpointError, match="no target sharding for b"):
        ckpt.restore(tmp_path, abstract_state=abstract)
    # the extra leaf named as the pytree indexes it (it said "only abstract_state has b";
    # a tuple's third leaf read "has 2")
    with pytest.raises(ckpt.CheckpointError, match=r"only abstract_state has leaves \['b'\]"):
        ckpt.restore(tmp_path, {"w": sh}, abstract)


def test_python_and_numpy_leaves(tmp_path):
    rep = NamedSharding(autopar.make_mesh({"data": 8}), PartitionSpec())
    ckpt.save(tmp_path, {"w": jnp.arange(8.0), "step": 3, "ids": np.arange(4), "lr": 0.5})
    got = ckpt.restore(tmp_path, {"w": rep, "step": rep, "ids": rep, "lr": rep})
    assert_trees_close(
        got,
        {"w": jnp.arange(8.0), "step": jnp.int32(3), "ids": jnp.arange(4), "lr": jnp.float32(0.5)},
    )
    abstract = {
        "w": jax.ShapeDtypeStruct((8,), jnp.float32),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "ids": jax.ShapeDtypeStruct((4,), jnp.int32),  # saved as int64, restored canonical
        "lr": jax.ShapeDtypeStruct((), jnp.float32),
    }
    assert_trees_close(ckpt.restore(tmp_path, rep, abstract), got)


def test_restore_with_a_plan_whose_argument_is_one_array_says_so(tmp_path):
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    w, x = jnp.ones((16, 16)), jnp.ones((8, 16))
    plan = autopar.parallelize(step, mesh={"data": 8}).plan(w, x)
    ckpt.save(tmp_path, {"w": w})
    with pytest.raises(ckpt.CheckpointError, match="argument 1 of the plan for .* is one array"):
        ckpt.restore(tmp_path, plan, argnum=1)
