"""A convolution lowered per device (`shard_map`) costs what the plain `jax.jit` program
of the same shardings costs.

A batch norm upcasts a bf16 convolution's result to f32 for its statistics. XLA:CPU
computes bf16 convolutions in f32; when the upcast reads the convolution directly it
keeps the f32 result, but behind the `shard_map` boundary's copies it rounded to bf16
and back, two extra passes over the activation (on the Wide-ResNet suite rows, most of
the HBM bytes autopar's FSDP program read beyond plain FSDP's). The cast runs inside
the convolution's `shard_map` instead (`autopar.lower.jit._casts_of`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.meshes import make_mesh
from autopar.tools.hlo import parse_collectives

MESH = {"data": 2, "model": 2}
X = jax.ShapeDtypeStruct((32, 16, 16, 128), jnp.bfloat16)
W = jax.ShapeDtypeStruct((3, 3, 128, 128), jnp.bfloat16)
SPECS = (P(("data", "model")), P())  # batch over every device, kernel replicated


def conv_bn(x, w):
    """A convolution and a batch norm's training-mode statistics, as flax computes them."""
    y = jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    y32 = y.astype(jnp.float32)
    mean = jnp.mean(y32, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(y32 - mean), axis=(0, 1, 2))
    return jnp.sum(var), y


def _programs():
    mesh = make_mesh(MESH)
    par = autopar.parallelize(conv_bn, mesh=MESH, engine="dp", in_specs=SPECS, cluster="cpu")
    plan = par.plan(X, W)
    shard = tuple(NamedSharding(mesh, s) for s in SPECS)
    plain = jax.jit(conv_bn, in_shardings=shard)
    return mesh, par, plan, plain


def test_batch_norm_upcast_costs_what_plain_jit_costs():
    mesh, par, plan, plain = _programs()
    (conv,) = [o for o in plan.ops if o.op == "conv_general_dilated"]
    # the plan convolves each device's batch shard with the whole kernel
    batch = conv.in_specs[0].dims
    assert tuple(batch[0]) == ("data", "model") and not any(batch[1:]), str(plan)
    assert not any(conv.in_specs[1].dims), str(plan)
    ours, theirs = par.lower(X, W).compile(), plain.lower(X, W).compile()
    cost = lambda c: (
        c.cost_analysis()[0] if isinstance(c.cost_analysis(), list) else c.cost_analysis()
    )
    assert cost(ours)["flops"] == pytest.approx(cost(theirs)["flops"], rel=1e-6)
    # no f32 -> bf16 -> f32 round trip of the activation: 10.4 MB before, 8.8 MB after
    # (plain: 8.8 MB; the plan sums the variance as a scalar where jit sums 128 floats)
    assert cost(ours)["bytes accessed"] <= cost(theirs)["bytes accessed"]
    text = ours.as_text()
    entry = text[text.index("ENTRY") :]
    assert entry.count("bf16[8,16,16,128]{3,2,1,0} fusion(") == 1, entry  # y's own cast only
    # what the plan priced is what runs: the statistics' all-reduces
    found = sum(c.bytes for c in parse_collectives(text, mesh))
    assert found == sum(plan.cost.comm_bytes.values()), (found, plan.cost.comm_bytes)


def test_batch_norm_upcast_numerics():
    mesh, par, _, plain = _programs()
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, X.shape, X.dtype)
    w = (jax.random.normal(kw, W.shape, jnp.float32) / 30).astype(W.dtype)
    (v_ours, y_ours), (v_plain, y_plain) = par(x, w), plain(x, w)
    np.testing.assert_array_equal(np.asarray(y_ours, np.float32), np.asarray(y_plain, np.float32))
    np.testing.assert_allclose(float(v_ours), float(v_plain), rtol=1e-5)


# ---- grouped (depthwise) convolutions -------------------------------------------------


def _depthwise_step(channels: int):
    """A MobileNet block as flax writes it: a depthwise 3x3 conv (`feature_group_count`
    = channels; its kernel gradient is a `batch_group_count` conv), a pointwise 1x1 conv,
    and an SGD step."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(channels, (3, 3), feature_group_count=channels, use_bias=False)(x)
            return nn.Conv(channels, (1, 1), use_bias=False)(jax.nn.relu(x))

    model = Block()

    def step(params, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), loss

    return model, step


def _grouped(graph) -> list[int]:
    return [
        i
        for i, n in enumerate(graph.nodes)
        if n.op == "conv_general_dilated"
        and (n.params["feature_group_count"] > 1 or n.params["batch_group_count"] > 1)
    ]


@pytest.mark.parametrize("split", ["batch", "channels"])
def test_grouped_convolutions_shard_and_match_jit(split):
    """Data parallel (`batch`): every grouped conv, forward and gradients, runs on its
    batch shard (its kernel gradient was one op with no split, run whole on gathered
    activations: 5x the FLOPs of plain data parallelism on MobileNet); `channels`:
    pinned to a channel split, the depthwise convs split their groups and each device
    runs its share with a local group count. Both compute what jax.jit does."""
    from autopar.ir.capture import capture

    model, step = _depthwise_step(64)
    x = jnp.sin(jnp.arange(8 * 8 * 8 * 64, dtype=jnp.float32).reshape(8, 8, 8, 64) * 0.01)
    params = jax.tree.map(lambda p: p + 0.01, model.init(jax.random.key(0), x))
    if split == "batch":
        mesh, in_specs = {"data": 4}, None
    else:  # channels over `model`, batch over `data`
        mesh = {"data": 2, "model": 2}
        in_specs = (
            jax.tree.map(lambda p: P(*[None] * (p.ndim - 1), "model"), params),
            P("data"),
        )
    par = autopar.parallelize(step, mesh=mesh, cluster="cpu", in_specs=in_specs)
    plan = par.plan(params, x)
    grouped = _grouped(capture(step, (params, x)))
    assert len(grouped) >= 2  # the forward depthwise conv and its gradients
    axis = "data" if split == "batch" else "model"
    for i in grouped:
        op = plan.ops[i]
        assert axis in op.in_specs[0].used_axes, f"{op.op} {op.strategy} at {op.source}"
    got, want = par(params, x), jax.jit(step)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    if split == "batch":
        flops = lambda c: (
            c.cost_analysis()[0] if isinstance(c.cost_analysis(), list) else c.cost_analysis()
        )["flops"]
        shard = NamedSharding(make_mesh(mesh), P("data"))
        dp = jax.jit(step, in_shardings=(NamedSharding(make_mesh(mesh), P()), shard))
        assert flops(par.lower(params, x).compile()) <= 1.05 * flops(dp.lower(params, x).compile())
