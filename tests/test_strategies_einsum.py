"""`FactorRule.einsum`: a rule written as DTensor writes it ("bmk,bkn->bmn") is the rule
written factor by factor, and the registered rules built from it give the same
strategies as before; malformed strings are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from autopar.ir.capture import capture
from autopar.sharding import MeshInfo
from autopar.strategies import Factor, FactorRule, enumerate_factor_rule, strategies_for
from autopar.strategies.linalg import dot_general_rule

MESH = MeshInfo.build(("data", "model"), (2, 4), None, 8)


def _node(fn, *args):
    """The one op of `fn` on `args` and its graph."""
    g = capture(fn, tuple(jax.ShapeDtypeStruct(a, jnp.float32) for a in args))
    (node,) = g.nodes
    return node, g


def test_matmul():
    rule = FactorRule.einsum("mk,kn->mn", (64, 256), (256, 128))
    m, n, k = Factor(64, name="m"), Factor(128, name="n"), Factor(256, reduce=True, name="k")
    assert rule == FactorRule((m, n, k), ((0, 2), (2, 1)), ((0, 1),))
    node, g = _node(lambda a, b: a @ b, (64, 256), (256, 128))
    assert node.op == "dot_general"
    assert enumerate_factor_rule(rule, MESH) == enumerate_factor_rule(
        dot_general_rule(node, g), MESH
    )
    # sharding k leaves the result Partial over that axis
    k_on_model = [s for s in enumerate_factor_rule(rule, MESH) if s.assignment == (None, 2)]
    assert [s.out_specs[0].partial for s in k_on_model] == [("model",)]


def test_batched_matmul():
    rule = FactorRule.einsum("bmk, bkn -> bmn", (8, 64, 32), (8, 32, 16))
    b, m, n = Factor(8, name="b"), Factor(64, name="m"), Factor(16, name="n")
    k = Factor(32, reduce=True, name="k")
    assert rule == FactorRule((b, m, n, k), ((0, 1, 3), (0, 3, 2)), ((0, 1, 2),))
    node, g = _node(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y), (8, 64, 32), (8, 32, 16))
    assert enumerate_factor_rule(rule, MESH) == enumerate_factor_rule(
        dot_general_rule(node, g), MESH
    )


def test_contracted_letters_are_numbered_alphabetically():
    """After the results' letters, whatever order the operands name them in."""
    rule = FactorRule.einsum("mlk,kln->mn", (4, 6, 8), (8, 6, 2))
    assert [f.name for f in rule.factors] == ["m", "n", "k", "l"]
    assert rule.in_dims == ((0, 3, 2), (2, 3, 1))


def test_elementwise():
    rule = FactorRule.einsum("ab,ab->ab", (16, 32), (16, 32))
    a, b = Factor(16, name="a"), Factor(32, name="b")
    assert rule == FactorRule((a, b), ((0, 1), (0, 1)), ((0, 1),))
    node, g = _node(lambda x, y: x + y, (16, 32), (16, 32))
    assert node.op == "add"
    want = strategies_for(node, g, MESH).strategies
    got = enumerate_factor_rule(rule, MESH)
    assert tuple(got) == want[: len(got)]  # the rest: partial sums passed through `add`


def test_no_operands_and_new_dims():
    """An op with no inputs (an argument, iota) and a dim only the result has."""
    assert FactorRule.einsum("->ab", (4, 8)) == FactorRule(
        (Factor(4, name="a"), Factor(8, name="b")), (), ((0, 1),)
    )
    rule = FactorRule.einsum("a->ab", (4,), (4, 8))
    assert rule.in_dims == ((0,),) and rule.out_dims == ((0, 1),)
    assert FactorRule.einsum("ab->", (4, 8)).out_dims == ((),)  # a scalar result


@pytest.mark.parametrize(
    "spec, shapes, match",
    [
        ("mk,kn", [(2, 3), (3, 4)], "exactly one '->'"),
        ("mk->kn->mn", [(2, 3)], "exactly one '->'"),
        ("m1,1n->mn", [(2, 3), (3, 4)], "not letters"),
        ("...k,kn->...n", [(2, 3), (3, 4)], "not letters"),
        ("ii->i", [(3, 3)], "repeats a letter"),
        ("mk,kn->mn", [(2, 3)], "1 shapes for 2 operands"),
        ("mk,kn->mn", [(2, 3), (3, 4, 5)], "term 'kn' for a shape"),
        ("mk,kn->mn", [(2, 3), (5, 4)], "'k' is 3 and 5"),
        ("mk,kn->mnz", [(2, 3), (3, 4)], r"size of \['z'\]"),
    ],
)
def test_malformed(spec, shapes, match):
    with pytest.raises(ValueError, match=match):
        FactorRule.einsum(spec, *shapes)
