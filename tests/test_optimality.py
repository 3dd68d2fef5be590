"""`dp` and `recursive` against a proven ILP optimum on a real captured graph.

The issue's targets: `dp` within 1% of the ILP optimum, `recursive` within 10%
(the full measurement is `python -m benchmarks.optimality`). One GPT layer on a
(2, 4) mesh: the ILP proves optimality in seconds.
"""

import math

import pytest

import cost_models
from autopar import examples
from autopar.cost.model import CostModel
from autopar.ir.capture import capture
from autopar.meshes import make_mesh
from autopar.search import search
from autopar.search.evaluate import total_time
from autopar.search.problem import build_problem
from autopar.sharding import mesh_info

MESH = {"data": 2, "model": 4}
TARGETS = {"dp": 1.01, "recursive": 1.10}


def ratios(workload, mesh: dict = MESH, engines=tuple(TARGETS)) -> dict[str, float]:
    """Each engine's search objective over the ILP optimum, on one problem."""
    profile = cost_models.load("h100-sxm")
    info = mesh_info(make_mesh(mesh), profile.devices_per_node)
    graph = capture(workload.fn, workload.args)
    problem = build_problem(graph, info, CostModel(profile, info))
    ilp = search(problem, "ilp", math.inf)
    assert ilp.solver_info["ilp"]["optimal"], ilp.solver_info
    optimum = total_time(problem, ilp.choice)
    out = {}
    for engine in engines:
        got = total_time(problem, search(problem, engine, math.inf).choice)
        # No plan beats a proven optimum (beyond HiGHS's tolerances).
        assert got >= optimum * (1 - 1e-6), (engine, got, optimum)
        out[engine] = got / optimum
    return out


def test_dp_and_recursive_near_the_ilp_optimum_at_suite_widths():
    # GPT-1.3B widths (the optimality benchmark's GPT rows), one layer, batch 8 per device.
    w = examples.gpt(
        hidden=2048, layers=1, heads=32, seq=1024, vocab=51200, batch=64, dtype="bfloat16"
    )
    got = ratios(w)
    for engine, limit in TARGETS.items():
        assert got[engine] <= limit, got


def test_dp_and_recursive_near_the_ilp_optimum_at_tiny_widths():
    # Every op is latency-bound here and the optimum replicates almost everything:
    # recursive must not cut latency-bound ops, dp must not stall on its guessed kernel.
    got = ratios(examples.gpt(hidden=64, layers=1, heads=4, seq=32, vocab=256, batch=16))
    for engine, limit in TARGETS.items():
        assert got[engine] <= limit, got


@pytest.mark.parametrize("layers, batch", [(4, 1024), (6, 128)])
def test_dp_reaches_the_ilp_optimum_under_a_clipped_optimizer(layers, batch):
    """An MLP (LayerNorm, Dense with bias, written in a Python loop) trained by
    `optax.chain(clip_by_global_norm, adamw)` on 8 devices. 4 layers, batch 1024: dp's
    plan split the squares of the global norm over the devices and carried their sum as
    a Partial value through the adds of every gradient to one all-reduce at the root
    (10 us of latency, 1.40x the ILP). Only a move of the whole chain at once removes
    it, which a random forest seldom holds; the cone rounds of the forest descent do
    (`solvers.forest`). 6 layers, batch 128: the optimum runs the step whole (every op
    latency-bound), and every engine returned data parallelism (1.84x): dp now also
    starts from the replicated plan (`layouts.replicated_plan`)."""
    import types

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(layers):
                x = x + nn.Dense(256, name=f"layers_{i}")(nn.LayerNorm(name=f"ln_{i}")(x))
            return nn.Dense(8, name="head")(x)

    model = MLP()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def step(params, opt, x, y):
        def loss(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    x = jax.ShapeDtypeStruct((batch, 256), jnp.float32)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    args = (params, jax.eval_shape(tx.init, params), x, y)
    got = ratios(types.SimpleNamespace(fn=step, args=args), {"data": 8}, ("dp",))
    assert got["dp"] <= TARGETS["dp"], got


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_dp_and_recursive_near_the_ilp_optimum_on_tiny_decoders_as_users_write_them(name):
    """Decoders written as public Flax code writes them (`benchmarks.user_models_defs`:
    a Llama with RoPE, GQA and SwiGLU; a GPT-2 with tied embeddings, fused qkv and
    AdamW) at widths where every op is latency-bound, on 8 devices, where the optimum
    is data parallelism. `recursive` was 34.7x and 3.2x the ILP: D-Rec kept every op too
    small to cut whole while the matmuls around it were batch-split (an all-gather at
    each), and a position embedding's update split by its gradient's scatter was
    gathered at its end (a chain one-node moves do not undo)."""
    import types

    from benchmarks.user_models_defs import gpt2, llama

    builder = {"llama": llama, "gpt2": gpt2}[name]
    case = builder(dict(batch=8, seq=32, vocab=128, d=64, heads=4, kv_heads=2, ffn=176, layers=4))
    workload = types.SimpleNamespace(fn=case.step, args=case.args(concrete=False))
    got = ratios(workload, {"data": 8})
    for engine, limit in TARGETS.items():
        assert got[engine] <= limit, got


@pytest.mark.parametrize(
    "name, mesh",
    [("llama", {"data": 2, "model": 4}), ("gpt2", {"data": 2, "model": 2, "expert": 2})],
)
def test_no_layer_of_a_stack_keeps_a_layout_of_its_own(name, mesh):
    """The tiny decoders of the test above on 2-D and 3-D meshes, where the optimum is
    data parallelism over every axis (the ILP proves it on data 2 x model 4: 17.12 us,
    the `data` plan's objective). D-Rec decides layer 0 first and left it in a layout of
    its own (the Llama's rotary region `S[model]S[data]` between `S[data,model]`
    neighbours; GPT-2's MLP split over `expert` on its hidden dim), in its forward and
    backward ops at once, which no forest move undoes: `recursive` was 2.17x (Llama) and
    5.6x (GPT-2) the `data` plan, `dp` 1.59x on the Llama. Layer transplants
    (`search.transplant`: another layer's plan copied op for op) reach it."""
    from benchmarks.user_models_defs import gpt2, llama

    case = {"llama": llama, "gpt2": gpt2}[name](
        dict(batch=8, seq=32, vocab=128, d=64, heads=4, kv_heads=2, ffn=176, layers=4)
    )
    profile = cost_models.load("h100-sxm")
    info = mesh_info(make_mesh(mesh), profile.devices_per_node)
    problem = build_problem(
        capture(case.step, case.args(concrete=False)), info, CostModel(profile, info)
    )
    data = total_time(problem, search(problem, "data", math.inf).choice)
    got = {e: total_time(problem, search(problem, e, math.inf).choice) / data for e in TARGETS}
    assert max(got.values()) <= 1.01, got
