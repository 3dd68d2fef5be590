"""Mesh search (`mesh=8` / `mesh="auto"`: the driver prices every candidate shape and keeps
the cheapest) and the `propagate` engine the baselines use (specs flow from the pinned
nodes to their neighbours)."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
import cost_models
from autopar.meshes import mesh_candidates
from autopar.plan.plan import is_note

CLUSTER = "cpu"


def _layer(x, w):
    return jnp.tanh(x @ w)


# a batch of 2 and 4 output features: split both (2 x 4 or 4 x 2 devices) and nothing
# moves; 8 devices on one axis must split the contraction and all-reduce
ARGS = (jax.ShapeDtypeStruct((2, 4096), jnp.float32), jax.ShapeDtypeStruct((4096, 4), jnp.float32))


@pytest.mark.parametrize("mesh", [8, "auto"])
def test_mesh_search_keeps_the_cheapest_candidate_shape(mesh):
    """With a device count (or "auto": the 8 simulated devices) the driver tries every
    candidate shape; the plan's mesh is the one whose own plan (asked for that shape
    explicitly) is the cheapest, and its price is that plan's price."""
    dpn = cost_models.load(CLUSTER).devices_per_node
    shapes = mesh_candidates(8, dpn)
    assert len(shapes) >= 3, shapes  # (8,), (2, 4), (4, 2), ... : a real choice
    prices = {
        tuple(s.items()): autopar.parallelize(_layer, mesh=s, cluster=CLUSTER)
        .plan(*ARGS)
        .cost.step_s
        for s in shapes
    }
    assert len(set(prices.values())) > 1, prices  # the shapes price differently
    plan = autopar.parallelize(_layer, mesh=mesh, cluster=CLUSTER).plan(*ARGS)
    chosen = tuple(plan.mesh.shape.items())
    cheapest = min(prices.values())
    assert chosen in prices, (chosen, list(prices))
    assert prices[chosen] == pytest.approx(cheapest, rel=1e-9), (chosen, prices)
    assert plan.cost.step_s == pytest.approx(cheapest, rel=1e-9)


def test_mesh_search_screens_shapes_and_searches_the_promising_ones_in_full():
    """Every shape is first priced by `recursive`'s plan (the "screen" phase); a shape
    whose screen price is above SCREEN_MARGIN x the best plan found is not searched in
    full, and the plan says which and why. Here `{"data": 8}` must split the
    contraction (an all-reduce) and is left out; the plan is still the cheapest of all
    shapes planned one by one."""
    from autopar.compile.screen import SCREEN_MARGIN

    dpn = cost_models.load(CLUSTER).devices_per_node
    prices = {
        tuple(s.items()): autopar.parallelize(_layer, mesh=s, cluster=CLUSTER)
        .plan(*ARGS)
        .cost.step_s
        for s in mesh_candidates(8, dpn)
    }
    plan = autopar.parallelize(_layer, mesh=8, cluster=CLUSTER).plan(*ARGS)
    assert plan.phases["screen"] > 0
    (note,) = [w for w in plan.warnings if "not searched in full" in w]
    assert note.startswith(f"mesh-shape search over {len(prices)} shapes, not searched in full: 1 ")
    assert "{'data': 8}" in note and is_note(note), note  # informs: printed as a note
    # on one 8-device node, 4 x 2 is 2 x 4 with its axes renamed: searched once
    assert "{'data': 4, 'model': 2} as {'data': 2, 'model': 4}" in note, note
    assert prices[(("data", 4), ("model", 2))] == pytest.approx(prices[(("data", 2), ("model", 4))])
    assert prices[(("data", 8),)] > SCREEN_MARGIN * plan.cost.step_s
    assert plan.cost.step_s == pytest.approx(min(prices.values()), rel=1e-9)


def test_a_device_count_below_the_memory_floor_is_not_screened(monkeypatch):
    """All shapes of one device count share a memory floor: when it is over the budget
    no shape is built or screened, and the error says the floor is what failed."""
    import autopar.compile.driver as driver

    def never(*a, **k):
        raise AssertionError("screened")

    monkeypatch.setattr(driver, "screen", never)
    with pytest.raises(autopar.MemoryBudgetError, match="memory_floor"):
        autopar.parallelize(_layer, mesh=8, cluster=CLUSTER, memory_budget=1e3).plan(*ARGS)


def test_equivalent_meshes_are_relabelings_with_the_same_node_boundaries():
    """`meshes.equivalent`: same axis sizes up to a relabeling, and every group of axes
    inside a node in one exactly when in the other."""
    from jax.sharding import AbstractMesh

    from autopar.meshes import equivalent
    from autopar.sharding import mesh_info

    def info(shape, per_node=8):
        return mesh_info(AbstractMesh(tuple(shape.values()), tuple(shape)), per_node)

    same = info({"data": 32, "model": 2, "expert": 4}), info({"data": 32, "model": 4, "expert": 2})
    assert equivalent(*same)
    # a 128-wide model axis spans nodes, a 2-wide one does not
    assert not equivalent(info({"data": 2, "model": 128}), info({"data": 128, "model": 2}))
    # on 4-device nodes the inner axis of 4 x 2 stays in a node with data crossing
    # nodes, while 2 x 4's inner 4 fills a node: different links for different sizes
    assert not equivalent(info({"data": 4, "model": 2}, 4), info({"data": 2, "model": 4}, 4))
    assert equivalent(info({"data": 4, "model": 2}, 8), info({"data": 2, "model": 4}, 8))
    assert not equivalent(info({"data": 8}), info({"data": 2, "model": 4}))


# ---------------------------------------------------------------------------- propagate


def _problem(fn, args, mesh):
    from jax.sharding import AbstractMesh

    from autopar.cost.model import CostModel
    from autopar.ir.capture import capture
    from autopar.search.problem import build_problem
    from autopar.sharding import mesh_info

    profile = cost_models.load(CLUSTER)
    info = mesh_info(AbstractMesh(tuple(mesh.values()), tuple(mesh)), profile.devices_per_node)
    return build_problem(capture(fn, args), info, CostModel(profile, info))


def _find(problem, v, ok) -> int:
    return next(k for k, s in enumerate(problem.strategies[v]) if ok(s))


@pytest.mark.parametrize("pinned", ["rows of x", "columns of w"])
def test_propagate_carries_pinned_specs_to_their_neighbours(pinned):
    """`propagate` on tanh(x @ w) over 8 devices: with x pinned split by rows (w whole),
    the matmul reads both as pinned and its output and the tanh are split by rows; with
    w pinned split by columns (x whole), both are split by columns. Either way nothing
    is resharded. (The two pins need different answers, so a propagation that ignored
    its neighbours could not pass both.)"""
    from autopar.search.engines import propagate
    from autopar.sharding import Spec

    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    problem = _problem(lambda w, x: jnp.tanh(x @ w), (w, x), {"data": 8})
    rep, rows, cols = Spec.replicated(2), Spec((("data",), ())), Spec(((), ("data",)))
    split = rows if pinned == "rows of x" else cols
    w_spec, x_spec = (rep, rows) if pinned == "rows of x" else (cols, rep)
    pins = {
        0: _find(problem, 0, lambda s: s.out_specs[0] == w_spec),
        1: _find(problem, 1, lambda s: s.out_specs[0] == x_spec),
    }
    choice = propagate(problem, pins)
    dot, tanh = 2, 3
    got_dot = problem.strategies[dot][choice[dot]]
    got_tanh = problem.strategies[tanh][choice[tanh]]
    assert got_dot.in_specs == (x_spec, w_spec), str(got_dot)
    assert got_dot.out_specs[0] == split, str(got_dot)
    assert got_tanh.in_specs[0] == split and got_tanh.out_specs[0] == split, str(got_tanh)
    # the pins are kept
    assert choice[0] == pins[0] and choice[1] == pins[1]


def test_propagate_decides_in_breadth_first_order_from_the_pins():
    """On a hand-made chain 0 - 1 - 2 - 3 (two strategies each, equal node costs, a
    mismatch across an edge costs 1), pinning node 0 to strategy 1 makes every node
    reachable from it take strategy 1; a node no pin reaches (4) takes its cheapest."""
    from types import SimpleNamespace

    from autopar.search.engines import propagate

    mismatch = np.array([[0.0, 1.0], [1.0, 0.0]])
    problem = SimpleNamespace(
        strategies=[("a", "b")] * 5,
        node_time=[np.zeros(2)] * 4 + [np.array([0.5, 0.1])],
        edges={(0, 1): mismatch, (1, 2): mismatch, (2, 3): mismatch},
    )
    assert propagate(problem, {0: 1}) == [1, 1, 1, 1, 1]
    assert propagate(problem, {3: 0}) == [0, 0, 0, 0, 1]


class _ResBlock(nn.Module):
    ch: int

    @nn.compact
    def __call__(self, x, temb):
        h = nn.Conv(self.ch, (3, 3))(nn.silu(nn.GroupNorm(num_groups=4)(x)))
        h = h + nn.Dense(self.ch)(nn.silu(temb))[:, None, None, :]
        h = nn.Conv(self.ch, (3, 3))(nn.silu(nn.GroupNorm(num_groups=4)(h)))
        return (x if x.shape[-1] == self.ch else nn.Conv(self.ch, (1, 1))(x)) + h


class _UNet(nn.Module):
    """A diffusion denoiser as public Flax code writes one: GroupNorm, a sinusoidal time
    embedding added in every block, skips concatenated on the way up."""

    @nn.compact
    def __call__(self, x, t):
        freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(8) / 8)
        arg = t[:, None].astype(jnp.float32) * freqs[None]
        temb = nn.Dense(64)(jnp.concatenate([jnp.sin(arg), jnp.cos(arg)], -1))
        temb = nn.Dense(64)(nn.silu(temb))
        h = nn.Conv(16, (3, 3))(x)
        skips = [h]
        for i, ch in enumerate((16, 32)):
            h = _ResBlock(ch)(h, temb)
            skips.append(h)
            if i == 0:
                h = nn.Conv(ch, (3, 3), strides=(2, 2))(h)
                skips.append(h)
        h = _ResBlock(32)(h, temb)
        for i, ch in reversed(list(enumerate((16, 32)))):
            h = _ResBlock(ch)(jnp.concatenate([h, skips.pop()], -1), temb)
            if i > 0:
                h = _ResBlock(ch)(jnp.concatenate([h, skips.pop()], -1), temb)
                b, hh, ww, c = h.shape
                h = nn.Conv(ch, (3, 3))(jax.image.resize(h, (b, 2 * hh, 2 * ww, c), "nearest"))
        h = _ResBlock(16)(jnp.concatenate([h, skips.pop()], -1), temb)
        return nn.Conv(3, (3, 3))(nn.silu(nn.GroupNorm(num_groups=4)(h)))


@pytest.mark.slow  # two full mesh searches, ~20 s
def test_the_screen_keeps_a_two_axis_shape_whose_recursive_plan_is_poor():
    """A UNet trained on noised images on 8 devices: `recursive`'s plan on data 2 x
    model 4 cut some convs' channels and left the adds after them whole (a reshard at
    each, 11x the full search's plan), so the screen dropped that shape and `mesh=8`
    returned data=8's plan, 2.7x dearer than the full search of the shape it dropped.
    The screen also prices each shape of two or more axes from data parallelism's pins
    and keeps the cheaper."""
    model, tx = _UNet(), optax.adam(1e-3)

    def step(params, opt, x0, key):
        k1, k2 = jax.random.split(key)
        t = jax.random.randint(k1, (x0.shape[0],), 0, 1000)
        noise = jax.random.normal(k2, x0.shape)
        abar = (jnp.cos((t / 1000.0 + 0.008) / 1.008 * jnp.pi / 2) ** 2)[:, None, None, None]
        xt = jnp.sqrt(abar) * x0 + jnp.sqrt(1 - abar) * noise
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, xt, t) - noise) ** 2))(
            params
        )
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    x = jax.ShapeDtypeStruct((8, 16, 16, 3), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x, jnp.zeros((8,), jnp.int32))
    args = (params, jax.eval_shape(tx.init, params), x, jax.random.key(0))

    def price(mesh) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return autopar.parallelize(step, mesh=mesh).plan(*args).cost.step_s

    assert price(8) <= price({"data": 2, "model": 4}) * (1 + 1e-9)


def test_pipeline_auto_tries_every_tensor_width_without_a_pipeline():
    """`pipeline_stages="auto"`'s shapes: per stage count the widest tensor axis a node
    holds, and without a pipeline every width (a trial's ViT-B/16 on 64 devices ran
    best as data 16 x model 4, which the one unpipelined shape, model 8, missed); one
    1-D shape (data n and model n are one mesh)."""
    from autopar.meshes import pipeline_meshes

    shapes = pipeline_meshes(64, 8)
    plain = [m for m in shapes if "stage" not in m]
    assert plain == [{"data": 64}, {"data": 32, "model": 2}, {"data": 16, "model": 4},
                     {"data": 8, "model": 8}]  # fmt: skip
    assert all(m["model"] == 8 for m in shapes if "stage" in m and m["stage"] <= 8)
    assert pipeline_meshes(2, 8) == [{"data": 2}, {"stage": 2}]
