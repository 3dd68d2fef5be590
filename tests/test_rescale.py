"""`passes.rescale`: a step's graph at another micro-batch size, derived from the step
traced at the whole batch and at one micro-batch size, is the graph tracing at that
size gives (types and params), on decoders with their layers unrolled in Python and
rolled into one loop over them (what pipeline tries are priced on); and where the two
traces do not allow it, it says so."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest
from test_pipeline_unrolled import GPT2, LAYERS, Llama, T, _linen

from autopar.ir.capture import capture
from autopar.passes.rescale import rescaled
from autopar.passes.roll import roll
from autopar.passes.stacks import find_stacks


def _rolled(step, params, opt_state, batch: int):
    graph = capture(step, (params, opt_state, jnp.zeros((batch, T), jnp.int32)))
    (stack,) = find_stacks(graph)
    return roll(graph, stack, LAYERS)[0]


def _same(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _differences(a, b) -> list[str]:
    out = [f"value {i}: {x} != {y}" for i, (x, y) in enumerate(zip(a.values, b.values)) if x != y]
    for x, y in zip(a.nodes, b.nodes, strict=True):
        assert x.op == y.op
        out += [
            f"{x.op} {k}: {x.params[k]} != {y.params[k]}"
            for k in x.params
            if k != "jaxpr" and not _same(x.params[k], y.params[k])  # a loop's: kept stale
        ]
        if x.body is not None:
            out += _differences(x.body, y.body)
    return out


@pytest.mark.parametrize("model", [Llama, pytest.param(GPT2, marks=pytest.mark.slow)])
def test_a_derived_micro_batch_graph_is_the_traced_one(model):
    step, params, opt_state = _linen(model())
    full, half, quarter = (_rolled(step, params, opt_state, b) for b in (8, 4, 2))
    derived = rescaled(full, half, 2, 4)  # 4 micro-batches, from the trace at 2
    assert derived is not None
    assert len(derived.nodes) == len(quarter.nodes)
    assert not _differences(derived, quarter)
    assert derived.values != full.values  # it did change: the batch dims are 2, not 8


def test_traces_the_batch_does_not_explain_are_refused():
    step, params, opt_state = _linen(Llama())
    full, half = _rolled(step, params, opt_state, 8), _rolled(step, params, opt_state, 4)
    assert rescaled(full, half, 3, 4) is None  # 8 is no multiple of 3 x 4
    assert rescaled(full, half, 2, 3) is None  # 8 does not cut into 3
    assert rescaled(full, _rolled(*_linen(GPT2()), 4), 2, 4) is None  # another step
