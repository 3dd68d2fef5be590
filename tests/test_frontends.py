"""Frontends (`autopar.frontends`): `parallelize` as a drop-in for `jax.jit`, `nnx.jit`
and `eqx.filter_jit`. NNX graph nodes are traced as their state and updated in place;
Equinox modules keep their non-array leaves static; keyword arguments and defaults are
read as jax.jit reads them; jit wrappers are unwrapped."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autopar
from tests.helpers import assert_trees_close, is_sharded

eqx = pytest.importorskip("equinox")

MESH = {"data": 2, "model": 4}
# On the default profile these small steps run fastest replicated; a budget of 1.5 MB a
# device (the parameters and Adam's moments take 1.2 MB) makes the plans shard them.
BUDGET = 1.5e6
BATCH, DIN, HIDDEN, DOUT = 64, 128, 256, 16


def _batch(i: int):
    """Step i's batch: position-dependent values, the same every step (losses fall)."""
    del i
    x = (jnp.arange(BATCH * DIN, dtype=jnp.float32).reshape(BATCH, DIN) % 97) / 97
    y = jnp.sin(jnp.arange(BATCH * DOUT, dtype=jnp.float32).reshape(BATCH, DOUT) / 50)
    return x, y


def _sharded(plan) -> bool:
    return any(is_sharded(r.spec.to_pspec()) for r in plan.inputs)


# ---- Flax NNX -----------------------------------------------------------------------------


class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(DIN, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.l3 = nnx.Linear(HIDDEN, DOUT, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


def _nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _nnx_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


def _nnx_args():
    model = _MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), *_batch(0)


# Adam divides each gradient entry by its running RMS, so an entry whose gradient is
# near zero gets an update (up to lr = 1e-2 a step) fixed by the last bits of m / sqrt(v),
# which a sharded program's summation order changes: after 3 steps such parameters
# differ from nnx.jit's by ~1e-5 (0.1% of one step's update), just over f32's default
# atol. The losses, and every other parameter, keep the default tolerance.
ADAM_ATOL = 5e-5


def _nnx_run(wrap, steps: int = 3):
    model, optimizer, *_ = _nnx_args()
    step = wrap(_nnx_step)
    losses = [step(model, optimizer, *_batch(i)) for i in range(steps)]
    return jnp.stack(losses), nnx.state(model, nnx.Param), step, model, optimizer


def test_nnx_idiomatic_step_matches_nnx_jit():
    ref_losses, ref_params, *_ = _nnx_run(nnx.jit)
    losses, params, step, model, optimizer = _nnx_run(
        lambda f: autopar.parallelize(f, mesh=MESH, memory_budget=BUDGET)
    )
    assert float(ref_losses[0]) != float(ref_losses[1])  # the parameters change
    assert_trees_close(losses, ref_losses)
    assert_trees_close(params, ref_params, atol=ADAM_ATOL)
    assert int(optimizer.step[...]) == 3
    assert len(step._cache) == 1  # the state's new values hit the same program
    assert _sharded(step.plan(model, optimizer, *_batch(0)))


class _Sowing(nnx.Module):
    """A layer that sows an aux loss, as NNX MoE code does."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(DIN, DIN, rngs=rngs)

    def __call__(self, x):
        y = self.lin(x)
        self.sow(nnx.Intermediate, "aux_loss", jnp.mean(y**2))
        return y


def _sown_then_popped(wrap) -> tuple:
    """An eval that leaves the sown Variable on the model, then a train step (which pops
    it) on a model that sowed in an eager call: what each leaves on the module."""
    x = _batch(0)[0]

    def evaluate(model, x):
        return model(x).sum()

    def train(model, opt, x):
        def loss_fn(m):
            y = m(x)
            return jnp.mean(y) + 0.01 * sum(jax.tree.leaves(nnx.pop(m, nnx.Intermediate)))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    model = _Sowing(nnx.Rngs(0))
    out = wrap(evaluate)(model, x)
    sown = nnx.state(model, nnx.Intermediate)
    model2 = _Sowing(nnx.Rngs(1))
    model2(x)  # an eager call leaves its aux loss on the module
    opt = nnx.Optimizer(model2, optax.sgd(0.1), wrt=nnx.Param)
    loss = wrap(train)(model2, opt, x)
    return out, sown, loss, nnx.state(model2, nnx.Intermediate), nnx.state(model2, nnx.Param)


def test_variables_a_step_adds_or_pops_are_written_back_as_nnx_jit_does():
    """A function that sows (adds an `Intermediate`) or pops one changes the structure
    of the module's state: autopar refused both ("create every Variable before the
    call"); now the new Variable is added to the caller's module and the popped one
    removed, with the values `nnx.jit` gives."""
    want = _sown_then_popped(nnx.jit)
    got = _sown_then_popped(lambda f: autopar.parallelize(f, mesh=MESH))
    assert "aux_loss" in got[1] and not got[3]  # added by the eval, popped by the step
    assert_trees_close(got, want)


def test_nnx_jit_and_jax_jit_wrapped_steps():
    ref_losses, ref_params, *_ = _nnx_run(nnx.jit)
    losses, params, step, *_ = _nnx_run(
        lambda f: autopar.parallelize(nnx.jit(f), mesh=MESH, memory_budget=BUDGET)
    )
    assert_trees_close(losses, ref_losses)
    assert_trees_close(params, ref_params, atol=ADAM_ATOL)
    assert step.static_argnums == ()  # nnx.jit's static_argnums=None did not overwrite it
    assert step.__wrapped__ is not None and step.__name__ == "_nnx_step"
    assert _sharded(step.plan(*_nnx_args()))

    def matmul(w, x):
        return jnp.tanh(x @ w)

    w, (x, _) = jnp.arange(DIN * HIDDEN, dtype=jnp.float32).reshape(DIN, HIDDEN) / 1e4, _batch(0)
    par = autopar.parallelize(jax.jit(matmul), mesh=MESH)
    assert_trees_close(par(w, x), jax.jit(matmul)(w, x))
    assert [r.path for r in par.plan(w, x).inputs] == ["w", "x"]


def test_nnx_state_named_by_its_paths():
    plan = autopar.parallelize(_nnx_step, mesh=MESH).plan(*_nnx_args())
    paths = [r.path for r in plan.inputs]
    assert "model/l1/kernel" in paths and "model/l3/bias" in paths
    assert "optimizer/opt_state/0/mu/l2/kernel" in paths and "optimizer/step" in paths
    assert paths[-2:] == ["x", "y"]


def test_nnx_module_returned_and_rngs_updated():
    """A module that is an argument comes back as the caller's object; Rngs advance."""

    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(DIN, HIDDEN, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    def fwd(model, x):
        return model, model(x)

    x, _ = _batch(0)
    ref_model, model = Noisy(nnx.Rngs(1)), Noisy(nnx.Rngs(1))
    step = autopar.parallelize(fwd, mesh=MESH)
    for _ in range(2):
        _, ref = nnx.jit(fwd)(ref_model, x)
        back, out = step(model, x)
        assert back is model
        assert_trees_close(out, ref)  # same dropout masks: the rng state advanced alike
    keys = lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a
    assert_trees_close(
        jax.tree.map(keys, nnx.state(model)), jax.tree.map(keys, nnx.state(ref_model))
    )
    # model.eval() changes the graphdef (Dropout.deterministic): a program of its own
    model.eval()
    _, out = step(model, x)
    assert len(step._cache) == 2
    assert_trees_close(out, model.lin(x))


def test_a_plan_made_on_a_device_count_binds_to_its_mesh_with_nnx_dropout(tmp_path):
    """NNX's dropout reshards its key to its input's sharding: under autopar's mesh (one
    mesh asked for) the trace held those `reshard`s, without a mesh (`mesh=N`, whose
    shapes are searched) it did not, so a plan made with `mesh=8` did not bind on the
    mesh it chose ("a different computation"). They lower to nothing on Auto axes and
    are left out of the graph."""
    from autopar.ir.capture import capture

    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(DIN, HIDDEN, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return jnp.mean(self.drop(self.lin(x)) ** 2)

    x, _ = _batch(0)
    model = Noisy(nnx.Rngs(1))
    mesh = autopar.make_mesh(MESH)
    assert not [
        n for n in capture(lambda m, x: m(x), (model, x), (), mesh).nodes if n.op == "reshard"
    ]
    plan = autopar.parallelize(lambda m, x: m(x), mesh=8).plan(model, x)
    plan.save(tmp_path / "p.json")
    again = autopar.parallelize(lambda m, x: m(x), mesh=plan.mesh.shape, plan=tmp_path / "p.json")
    ref = nnx.jit(lambda m, x: m(x))(Noisy(nnx.Rngs(1)), x)
    assert_trees_close(again(Noisy(nnx.Rngs(1)), x), ref)


# ---- Equinox ------------------------------------------------------------------------------


def _eqx_setup():
    model = eqx.nn.MLP(DIN, DOUT, HIDDEN, depth=2, key=jax.random.key(0))
    optim = optax.adam(1e-2)
    return model, optim, optim.init(eqx.filter(model, eqx.is_array))


def _eqx_step_fn(optim):
    def step(model, opt_state, x, y):
        def loss_fn(m):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def _eqx_run(wrap):
    model, optim, opt_state = _eqx_setup()
    step = wrap(_eqx_step_fn(optim))
    losses = []
    for i in range(3):
        model, opt_state, loss = step(model, opt_state, *_batch(i))
        losses.append(loss)
    return jnp.stack(losses), model, step, opt_state


def test_equinox_step_matches_filter_jit():
    ref_losses, ref_model, *_ = _eqx_run(eqx.filter_jit)
    losses, model, step, opt_state = _eqx_run(
        lambda f: autopar.parallelize(f, mesh=MESH, memory_budget=BUDGET)
    )
    assert float(ref_losses[0]) != float(ref_losses[1])
    assert_trees_close(losses, ref_losses)
    # Adam divides by the gradients' root mean square: the partitioned program's
    # reassociated sums move a near-zero gradient's update by ~lr * 1e-3
    assert_trees_close(
        eqx.filter(model, eqx.is_array), eqx.filter(ref_model, eqx.is_array), atol=1e-4
    )
    assert model.activation is ref_model.activation  # the static parts came back
    assert len(step._cache) == 1
    plan = step.plan(model, opt_state, *_batch(0))
    assert "model/layers/0/weight" in [r.path for r in plan.inputs]
    assert _sharded(plan)
    # wrapped in eqx.filter_jit: unwrapped, same numbers
    wrapped, wrapped_model, *_ = _eqx_run(
        lambda f: autopar.parallelize(eqx.filter_jit(f), mesh=MESH)
    )
    assert_trees_close(wrapped, ref_losses)


# ---- jax.jit parity: keywords, defaults, linen apply --------------------------------------


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.relu(nn.Dense(HIDDEN)(x))
        h = nn.Dropout(0.1, deterministic=not train)(h)
        return nn.Dense(DOUT)(h)


def test_linen_apply_with_train_flag_and_dropout():
    model = _Linen()
    x, _ = _batch(0)
    variables = model.init(jax.random.key(0), x)
    step = autopar.parallelize(model.apply, mesh=MESH)
    ref = jax.jit(model.apply, static_argnames="train")  # jax.jit traces keyword values
    assert_trees_close(step(variables, x), ref(variables, x))  # the default: not traced
    assert_trees_close(step(variables, x, train=False), ref(variables, x, train=False))
    assert _sharded(step.plan(variables, x))
    key = jax.random.key(3)
    out = step(variables, x, train=True, rngs={"dropout": key})
    want = ref(variables, x, train=True, rngs={"dropout": key})
    assert_trees_close(out, want)


def test_keyword_values_and_defaults_as_jax_jit():
    def f(w, x, *, scale=2.0, mode="tanh", bias=None):
        y = x @ w * scale
        y = jnp.tanh(y) if mode == "tanh" else jax.nn.relu(y)
        return y if bias is None else y + bias

    w = jnp.arange(DIN * HIDDEN, dtype=jnp.float32).reshape(DIN, HIDDEN) / 1e4
    x, _ = _batch(0)
    step = autopar.parallelize(f, mesh=MESH)
    ref = jax.jit(f, static_argnames=("mode",))
    assert_trees_close(step(w, x), ref(w, x))
    assert_trees_close(step(w, x, mode="relu", scale=0.5), ref(w, x, mode="relu", scale=0.5))
    b = jnp.ones((HIDDEN,))
    assert_trees_close(step(w, x, bias=b), ref(w, x, bias=b))
    assert [r.path for r in step.plan(w, x, bias=b).inputs] == ["w", "x", "bias"]
    assert [r.path for r in step.plan(w, x, mode="relu").inputs] == ["w", "x"]


def test_static_argnames():
    def f(x, n, act="tanh"):
        for _ in range(n):
            x = jnp.tanh(x) if act == "tanh" else x * 0.5
        return x.sum(0)

    x, _ = _batch(0)
    step = autopar.parallelize(f, mesh=MESH, static_argnames="n")
    ref = jax.jit(f, static_argnames="n")
    assert_trees_close(step(x, 2), ref(x, 2))
    assert_trees_close(step(x, n=3), ref(x, n=3))
    assert [r.path for r in step.plan(x, 2).inputs] == ["x"]
    # a jax.jit wrapper's static arguments are kept when it is unwrapped
    for wrapped in (jax.jit(f, static_argnums=1), jax.jit(f, static_argnames=("n", "act"))):
        par = autopar.parallelize(wrapped, mesh=MESH)
        want = jax.jit(f, static_argnames=("n", "act"))(x, 2, act="half")
        assert_trees_close(par(x, 2, act="half"), want)
    with pytest.raises(autopar.AutoparError, match=r"no parameter 'acts'.*did you mean 'act'"):
        autopar.parallelize(f, mesh=MESH, static_argnames=("acts",))
    # Python scalars passed positionally stay traced, as in jax.jit
    g = autopar.parallelize(lambda x, s: x * s, mesh=MESH)
    assert [r.path for r in g.plan(x, 0.5).inputs] == ["x", "s"]
    assert_trees_close(g(x, 0.5), x * 0.5)
    assert len(g._cache) == 1 and (g(x, 0.25) == x * 0.25).all() and len(g._cache) == 1


def test_update_wrapper_keeps_autopar_attributes():
    @functools.wraps(_nnx_step)
    def wrapped(*a, **k):
        return _nnx_step(*a, **k)

    wrapped.options = "not autopar's"
    wrapped.fn = None
    step = autopar.parallelize(wrapped, mesh=MESH, static_argnums=())
    assert step.fn is wrapped and not isinstance(step.options, str)


def test_nnx_state_checkpoints_and_in_shardings(tmp_path):
    """Plan.in_shardings names NNX state by its paths, the written-back state lives in
    those shardings, and nnx.state(model) saves and restores with autopar.checkpoint."""
    import autopar.checkpoint as ckpt

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(64, 256, rngs=rngs)
            self.l2 = nnx.Linear(256, 8, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    net = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.adam(1e-2), wrt=nnx.Param)
    x = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64) / 4096
    y = jnp.cos(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8))
    f = autopar.parallelize(step, mesh={"data": 2, "model": 4}, memory_budget=1.5e5)
    plan = f.plan(net, opt, x, y)
    f(net, opt, x, y)
    kernel_sharding = plan.in_shardings[0]["l1"]["kernel"]  # argument 0 is the model
    assert not kernel_sharding.is_fully_replicated
    assert net.l1.kernel[...].sharding.is_equivalent_to(kernel_sharding, 2)
    state = nnx.state(net)
    ckpt.save(tmp_path, state, 1)
    restored = ckpt.restore(tmp_path, jax.tree.map(lambda a: a.sharding, state))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    # restored straight into a plan's layout: its shardings are the state's pure dict
    # (`l1.kernel`), the checkpoint's names its Variables' values (`l1.kernel.value`)
    pure = ckpt.restore(tmp_path, plan)
    assert jax.tree.structure(pure) == jax.tree.structure(nnx.to_pure_dict(state))
    assert pure["l1"]["kernel"].sharding.is_equivalent_to(kernel_sharding, 2)
    for a, b in zip(jax.tree.leaves(pure), jax.tree.leaves(nnx.to_pure_dict(state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
