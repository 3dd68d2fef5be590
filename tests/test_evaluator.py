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
