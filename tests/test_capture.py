"""Capture: stable paths, inlined calls, source lines, opaque control flow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.errors import CaptureError
from autopar.ir.capture import capture
from autopar.ir.eval import evaluate
from autopar.ir.graph import check_graph, without_dead


def test_paths_name_arguments_and_pytree_keys():
    def f(params, x):
        return {"y": x @ params["w"], "n": jnp.sum(params["b"])}

    params = {
        "w": jax.ShapeDtypeStruct((4, 3), jnp.float32),
        "b": jax.ShapeDtypeStruct((3,), jnp.float32),
    }
    g = capture(f, (params, jax.ShapeDtypeStruct((2, 4), jnp.float32)))
    assert g.input_paths == ("params/b", "params/w", "x")
    assert g.output_paths == ("out/n", "out/y")
    assert [str(g.values[v]) for v in g.inputs] == ["float32[3]", "float32[4,3]", "float32[2,4]"]
    check_graph(g)


def test_calls_are_inlined_and_sources_point_at_user_code():
    @jax.jit
    def inner(x):
        return jax.nn.relu(x) * 2  # relu is a custom_jvp

    def f(x):
        return jax.checkpoint(lambda y: jnp.sin(inner(y)))(x)

    g = capture(jax.grad(lambda x: f(x).sum()), (jnp.ones((4,)),))
    ops = {n.op for n in g.nodes}
    assert not ops & {"pjit", "jit", "custom_jvp_call", "checkpoint", "remat"}
    assert "sin" in ops
    assert all(n.source.startswith("test_capture.py:") for n in g.nodes if n.op in ("sin", "cos"))


def test_without_dead_drops_what_nothing_reads_and_keeps_effects():
    """The gradient of sin(x) reads cos(x), not sin(x): the forward sin is dead and goes;
    a debug print stays (its effect), and so does what it reads."""

    def f(x):
        jax.debug.print("x {}", x.sum())
        return jnp.sin(x).sum()

    g = capture(jax.grad(f), (jnp.ones((4,)),))
    assert "sin" in [n.op for n in g.nodes]  # make_jaxpr keeps it
    pruned = without_dead(g)
    ops = [n.op for n in pruned.nodes]
    assert "sin" not in ops and {"cos", "debug_print", "reduce_sum"} <= set(ops)
    check_graph(pruned)
    x = jnp.arange(4.0)
    (got,) = evaluate(pruned, [x])
    assert jnp.allclose(got, jnp.cos(x))
    assert without_dead(pruned) is pruned  # nothing left to drop


def test_control_flow_stays_one_node():
    def f(x):
        return jax.lax.fori_loop(0, 3, lambda i, c: c * 2.0, x)

    g = capture(f, (jnp.arange(8.0),))
    assert [n.op for n in g.nodes] == ["scan"]  # fori_loop with static bounds is a scan


def test_scan_body_is_a_graph_with_loop_roles():
    def f(w, x):
        def body(c, wi):
            return jnp.tanh(c @ wi), c.sum()

        return jax.lax.scan(body, x, w)

    g = capture(f, (jnp.ones((3, 4, 4)), jnp.ones((2, 4))))
    (node,) = g.nodes
    body = node.body
    assert body.input_paths == ("body/carry0", "body/x0")
    assert body.output_paths == ("body/carry0", "body/y0")
    assert [body.values[v].shape for v in body.inputs] == [(2, 4), (4, 4)]
    assert [n.op for n in body.nodes] == ["dot_general", "tanh", "reduce_sum"]


def test_static_argnums_and_constants():
    def f(x, n):
        return x * n + np.arange(4.0)

    g = capture(f, (jnp.ones(4), 3), static_argnums=(1,))
    assert g.input_paths == ("x",)
    assert g.consts  # the literal 3 and the numpy array


def test_bad_function_names_user_code():
    def broken(x):
        return x @ x  # (3,) @ (3,) is fine; (2,3) @ (2,3) is not

    with pytest.raises(CaptureError, match=r"broken .*float32\[2, 3\]"):
        capture(broken, (jnp.ones((2, 3)),))
