"""The graph interpreter (`autopar.ir.eval`): a captured graph evaluated node by node."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_trees_close

from autopar.ir.capture import capture
from autopar.ir.eval import bind_node, evaluate, retrace, run_nodes


def _loop(w, x):
    """A scan whose body holds a cond, a literal and a closed-over constant."""
    table = np.arange(8, dtype=np.float32)

    def body(h, i):
        h = jax.lax.cond(i % 2 == 0, lambda h: jnp.tanh(h @ w), lambda h: h @ w.T + table, h)
        return h, jnp.sum(h) * 0.5

    h, sums = jax.lax.scan(body, x, jnp.arange(4))
    return jnp.mean(h**2) + jnp.sum(sums), h


def _args():
    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    return w, x


def _flat(args):
    return jax.tree_util.tree_leaves(args)


def test_default_hook_reproduces_jit():
    fn = jax.value_and_grad(_loop, has_aux=True)
    args = _args()
    graph = capture(fn, args)
    assert {"scan"} <= set(graph.op_counts())
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    got = evaluate(graph, _flat(args))
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    jitted = jax.jit(retrace(graph))(*_flat(args))
    assert isinstance(jitted, tuple)
    assert_trees_close(list(jitted), want, rtol=1e-6, atol=1e-6)
    # the scans (forward and backward) and their conds are bound as captured, not walked
    scans = [n for n in graph.nodes if n.op == "scan"]
    assert scans and all(any(n.op == "cond" for n in s.body.nodes) for s in scans)


def test_custom_hook_is_called_once_per_node():
    args = _args()
    graph = capture(_loop, args)
    seen: list[int] = []

    def hook(node, invals):
        assert len(invals) == len(node.inputs)
        seen.append(node.id)
        return bind_node(node, invals)

    got = evaluate(graph, _flat(args), hook)
    assert seen == [n.id for n in graph.nodes]
    assert_trees_close(got, jax.tree_util.tree_leaves(_loop(*args)), rtol=1e-6, atol=1e-6)


def test_hook_changes_what_a_node_computes():
    graph = capture(lambda x: jnp.sin(x) * 2.0, (jnp.ones(3),))
    cos = lambda node, invals: [jnp.cos(*invals)] if node.op == "sin" else bind_node(node, invals)
    (got,) = evaluate(graph, [jnp.zeros(3)], cos)
    np.testing.assert_allclose(got, 2.0 * np.ones(3))


def test_run_nodes_evaluates_a_piece_into_an_environment():
    graph = capture(lambda x: (x + 1.0) * 3.0, (jnp.ones(2),))
    env = {graph.inputs[0]: jnp.arange(2.0)}
    read = lambda v: graph.consts[v] if v in graph.consts else env[v]
    run_nodes(graph.nodes[:1], read, env)  # the add only
    first = graph.nodes[0].outputs[0]
    np.testing.assert_allclose(env[first], [1.0, 2.0])
    assert graph.nodes[1].outputs[0] not in env
