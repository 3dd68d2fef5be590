"""The benchmark evaluator's reading of XLA's buffers: the f32 copies of bf16 data that
XLA:CPU keeps (a GPU build does not), found in its dumped buffer assignment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks import evaluator as ev


def _chain(w, x):
    for _ in range(3):
        x = jnp.tanh(x @ w)
    return x


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_f32_copies_of_bf16_data_at_the_peak(tmp_path, dtype):
    args = [jax.ShapeDtypeStruct((256, 256), dtype), jax.ShapeDtypeStruct((512, 256), dtype)]
    lowered = jax.jit(_chain).lower(*args)
    compiled, _ = ev.compile_lowered(lowered, str(tmp_path))
    peaks = ev.f32_copies_at_peak(str(tmp_path))
    live, less = peaks["live_peak"], peaks["live_peak_less_f32_copies"]
    # the arguments (384 KiB in bf16) are live throughout
    assert live >= sum(a.size * jnp.dtype(dtype).itemsize for a in args)
    if dtype == jnp.float32:
        assert less == live  # nothing to upcast
    else:
        # the CPU computes the bf16 dots in f32: f32 copies of the operands or results,
        # each at least one [512, 256] f32 buffer (512 KiB)
        assert live - less >= 512 * 256 * 4, peaks
        m = ev.measure(compiled, jax.make_mesh((1,), ("data",)), dump_dir=str(tmp_path))
        assert m.memory["less_f32_copies"] == m.memory["total"] - (live - less)


# ------------------------------------------------- corrections on programs with a known answer


def _mesh8():
    return jax.make_mesh((8,), ("data",))


def _psum(dtype):
    """A shard_map all-reduce of a [1024, 256] block per device, in `dtype`."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh8()
    f = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
    )
    x = jax.ShapeDtypeStruct((8 * 1024, 256), dtype, sharding=NamedSharding(mesh, P("data")))
    return f.lower(x).compile(), mesh


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_bf16_collectives_are_priced_at_bf16_width(dtype):
    """XLA:CPU runs a bf16 all-reduce in f32 (twice the bytes); the evaluator prices it at
    the bf16 width a GPU moves: 1024 x 256 x 2 bytes. An f32 one is left as it is."""
    compiled, mesh = _psum(dtype)
    width = jnp.dtype(dtype).itemsize
    m = ev.measure(compiled, mesh)
    (c,) = m.collectives
    assert (c.kind, c.raw_kind, c.axes) == ("all-reduce", "all-reduce", ("data",))
    assert c.raw_bytes == 1024 * 256 * 4  # as compiled: f32 on the CPU either way
    assert c.bytes == 1024 * 256 * width
    assert c.upcast == (dtype == jnp.bfloat16)
    assert m.upcast_bytes == 1024 * 256 * (4 - width)
    raw = ev.measure(compiled, mesh, correct_bf16=False)
    assert raw.collectives[0].bytes == 1024 * 256 * 4 and raw.upcast_bytes == 0


def _matmul(out_spec):
    """[512, 1024] @ [1024, 256] with the contraction split over 8 devices: partial sums
    that are all-reduced (replicated output) or reduce-scattered (output split by rows),
    which XLA:CPU compiles as an all-reduce and a dynamic-slice."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh8()
    s = lambda *spec: NamedSharding(mesh, P(*spec))
    f = jax.jit(
        lambda a, b: a @ b,
        in_shardings=(s(None, "data"), s("data", None)),
        out_shardings=s(*out_spec),
    )
    args = (
        jax.ShapeDtypeStruct((512, 1024), jnp.float32),
        jax.ShapeDtypeStruct((1024, 256), jnp.float32),
    )
    return f.lower(*args).compile(), mesh


def test_all_reduce_then_dynamic_slice_is_priced_as_reduce_scatter():
    import cost_models
    from autopar.cost.model import CostModel
    from autopar.sharding import mesh_info

    full = 512 * 256 * 4
    compiled, mesh = _matmul(("data", None))
    text = compiled.as_text()
    assert " all-reduce(" in text and "dynamic-slice(" in text and "reduce-scatter(" not in text
    m = ev.measure(compiled, mesh)
    (c,) = m.collectives
    assert (c.kind, c.raw_kind, c.bytes, c.raw_bytes) == (
        "reduce-scatter",
        "all-reduce",
        full,
        full,
    )
    assert m.reclassified_rs == 1
    # priced with the reduce-scatter's bus factor (n - 1) / n, not the all-reduce's twice that
    prof = cost_models.load("h100-sxm")
    cm = CostModel(prof, mesh_info(mesh, prof.devices_per_node))
    priced = ev.price(m, prof, mesh, "float32")
    assert priced.comm_s == pytest.approx(cm.collective("reduce-scatter", ("data",), full).seconds)
    assert priced.comm_s < cm.collective("all-reduce", ("data",), full).seconds

    # the same partial sums wanted whole: an all-reduce, and it stays one
    compiled, mesh = _matmul(())
    m = ev.measure(compiled, mesh)
    (c,) = m.collectives
    assert (c.kind, c.bytes) == ("all-reduce", full) and m.reclassified_rs == 0


def _mlp_forward(w1, w2, x):
    return jax.nn.gelu(x @ w1) @ w2


def _mlp_gradient(w1, w2, x):
    loss = lambda w1, w2: jnp.mean(jnp.square(jax.nn.gelu(x @ w1) @ w2))
    return jax.grad(loss, argnums=(0, 1))(w1, w2)


PROGRAMS = {
    # (function, argument shapes)
    "chain256": (_chain, [(256, 256), (512, 256)]),
    "chain512": (_chain, [(512, 512), (1024, 512)]),
    "mlp_forward": (_mlp_forward, [(256, 1024), (1024, 256), (512, 256)]),
    "mlp_gradient": (_mlp_gradient, [(256, 1024), (1024, 256), (512, 256)]),
}


def _peaks(name, dtype, tmp_path):
    fn, shapes = PROGRAMS[name]
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    ev.compile_lowered(jax.jit(fn).lower(*args), str(tmp_path))
    return ev.f32_copies_at_peak(str(tmp_path))


@pytest.mark.parametrize(
    "name",
    [
        "chain256",
        "chain512",
        "mlp_forward",
        pytest.param(
            "mlp_gradient",
            marks=pytest.mark.xfail(
                strict=True,
                reason="known gap: on the gradient program the rule finds too few copies "
                "(2/3 of the f32 peak instead of 1/2), so less_f32_copies is an upper bound",
            ),
        ),
    ],
)
def test_memory_less_f32_copies_is_the_bf16_programs_own_footprint(tmp_path, name):
    """Where the answer is known: a GPU keeps every buffer of a bf16 program at half the
    width of the same program compiled in f32 (same ops, same schedule), so its peak is
    exactly half the f32 program's. The bf16 program's peak less the CPU's f32 copies
    is that. A copy is all extra when the bf16 value is in memory too; when it stands in
    for a bf16 value a GPU would keep, half of it is (an f32 buffer is twice the bf16
    one): the chains exercise the first case, the MLP forward the second (counting its
    copies whole gives 0.35 of the f32 peak, not 0.5)."""
    f32 = _peaks(name, jnp.float32, tmp_path / "f32")
    bf16 = _peaks(name, jnp.bfloat16, tmp_path / "bf16")
    assert f32["live_peak_less_f32_copies"] == f32["live_peak"]
    assert bf16["live_peak"] > f32["live_peak"] / 2  # the CPU's copies are there
    assert bf16["live_peak_less_f32_copies"] == f32["live_peak"] // 2, (f32, bf16)


def test_kernels_price_a_memory_bound_update_the_whole_program_roofline_hides():
    """`kernels`: a matmul and a conv give their exact FLOPs (2 x multiply-adds, read
    from the HLO: the sum is XLA's own count less the elementwise ops), and bytes as
    XLA's cost analysis counts them; priced kernel by kernel, an Adam-like update of a
    large vector (memory bound) adds its own time, which the whole-program roofline
    (max of all FLOPs and all bytes) hides behind the matmul's FLOPs (at float32's rate:
    at TF32's the whole program is memory bound too)."""
    import cost_models
    from autopar.cost.model import CostModel
    from autopar.sharding import mesh_info

    def step(w, x, k, img, v, m):
        y = jnp.tanh(x @ w)
        z = jax.lax.conv_general_dilated(
            img, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        m = 0.9 * m + 0.1 * v
        return y.sum() + z.sum(), v - 0.01 * m / (jnp.sqrt(m * m) + 1e-8), m

    n = 1 << 22
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = [f32(1024, 1024), f32(2048, 1024), f32(3, 3, 16, 32), f32(8, 32, 32, 16), f32(n), f32(n)]
    compiled = jax.jit(step).lower(*args).compile()
    mesh = jax.make_mesh((1,), ("data",))
    m = ev.measure(compiled, mesh)
    flops = sum(f * k for f, _, k in m.kernels)
    want = 2 * 2048 * 1024 * 1024 + 2 * (8 * 32 * 32 * 32) * (3 * 3 * 16)
    assert flops == want
    assert m.flops >= flops
    assert sum(b * k for _, b, k in m.kernels) == pytest.approx(m.bytes_accessed, rel=0.02)
    with jax.default_matmul_precision("highest"):  # float32 dots: FLOP-bound as a whole
        priced = ev.price(m, "h100-sxm", mesh, jnp.float32)
    cm = CostModel(cost_models.load("h100-sxm"), mesh_info(mesh, 8))
    update = cm.compute_seconds(0.0, 4 * n * 4, jnp.float32)  # reads v, m; writes both
    assert priced.compute_kernels_s >= priced.compute_s + 0.9 * update


def test_float32_dots_are_priced_at_the_rate_jax_runs_them():
    """A float32 matmul runs on tensor cores as TF32 under JAX's default matmul precision,
    so the evaluator prices its FLOPs at the profile's `tfloat32` peak (`dot_rate`); with
    `jax_default_matmul_precision="highest"` at the plain float32 one. Pricing every f32
    FLOP at the float32 peak made compute 7x too dear on h100-sxm, which hid the memory
    traffic a plan saves behind FLOPs that never cost that much."""
    import cost_models

    prof = cost_models.load("h100-sxm")
    mesh = jax.make_mesh((1,), ("data",))
    x = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    m = ev.measure(jax.jit(lambda a, b: a @ b).lower(x, x).compile(), mesh)
    dots = 2.0 * 2048**3
    assert sum(f * k for f, _, k in m.kernels) == dots
    tf32 = dots / (prof.flops_for("tfloat32") * prof.compute_efficiency)
    assert ev.price(m, prof, mesh, jnp.float32).compute_s == pytest.approx(tf32)
    with jax.default_matmul_precision("highest"):
        fp32 = ev.price(m, prof, mesh, jnp.float32).compute_s
    assert fp32 == pytest.approx(dots / (prof.flops_for(jnp.float32) * prof.compute_efficiency))
    assert fp32 > 5 * tf32


def test_an_all_to_all_is_priced_at_link_time_its_copies_as_kernels():
    """Moving a split from rows to columns compiles to an all-to-all and the copies that
    put its chunks in place, kernels of the program (priced with its compute). The
    evaluator prices the collective at link time only: the cost model's all-to-all,
    which adds those copies for the search, would count them twice."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import cost_models
    from autopar.cost.model import CostModel
    from autopar.sharding import mesh_info

    mesh = _mesh8()
    f = jax.jit(
        lambda x: x * 2.0,
        in_shardings=NamedSharding(mesh, P("data", None)),
        out_shardings=NamedSharding(mesh, P(None, "data")),
    )
    compiled = f.lower(jax.ShapeDtypeStruct((1024, 1024), jnp.float32)).compile()
    m = ev.measure(compiled, mesh)
    (c,) = m.collectives
    assert c.kind == "all-to-all"
    prof = cost_models.load("h100-sxm")
    cm = CostModel(prof, mesh_info(mesh, prof.devices_per_node))
    link = cm.collective("all-to-all", c.axes, c.bytes, copies=False).seconds
    assert cm.collective("all-to-all", c.axes, c.bytes).seconds > link
    assert ev.price(m, prof, mesh, "float32").comm_s == pytest.approx(link)
