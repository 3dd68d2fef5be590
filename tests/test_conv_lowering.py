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
