"""Fuzzing: random small programs from supported primitives, random shapes and meshes,
under every engine; the sharded program (forward values and gradients, in one
value-and-grad program) must equal the unsharded `jax.jit` one.

Hypothesis draws MAX_EXAMPLES programs, derandomized (the same cases on every run, so
CI is stable); each runs under all ENGINES, so MAX_EXAMPLES x 5 sharded runs. A
failing case is shrunk and printed as readable pseudo-code (`Program.__repr__`);
add it to REGRESSIONS below to keep it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar

MAX_EXAMPLES = 25
DIMS = (1, 2, 3, 4, 6, 8, 12, 16)
MESHES = ({"data": 8}, {"data": 2, "model": 4}, {"data": 4, "model": 2}, {"a": 2, "b": 2, "c": 2})
ENGINES = ("recursive", "dp", "data", "fsdp", "propagate")
OPS = (
    "dot",
    "add",
    "mul",
    "tanh",
    "exp",
    "reshape",
    "transpose",
    "reduce_sum",
    "reduce_max",
    "broadcast",
    "slice",
    "concatenate",
    "stack",
    "take",
)
MAX_SIZE = 4096  # elements per tensor, so shapes stay small


@dataclass(frozen=True)
class Op:
    name: str  # "input" (param: its shape) or one of OPS
    args: tuple[int, ...] = ()  # ids of earlier tensors (steps)
    param: tuple = ()


@dataclass(frozen=True)
class Program:
    """Straight-line code: step k defines tensor tk, an input or an op on earlier ones."""

    steps: tuple[Op, ...]

    @property
    def inputs(self) -> tuple[tuple[int, ...], ...]:
        return tuple(op.param for op in self.steps if op.name == "input")

    def __repr__(self) -> str:
        lines = []
        for k, op in enumerate(self.steps):
            if op.name == "input":
                lines.append(f"t{k} = input{list(op.param)}")
                continue
            args = ", ".join([f"t{a}" for a in op.args] + ([str(op.param)] if op.param else []))
            lines.append(f"t{k} = {op.name}({args})")
        return "Program:\n  " + "\n  ".join(lines)


def _apply(op: Op, t: list) -> jax.Array:
    a = t[op.args[0]]
    b = t[op.args[1]] if len(op.args) > 1 else None
    match op.name:
        case "dot":
            return (a @ b) / math.sqrt(b.shape[0])
        case "add":
            return a + b
        case "mul":
            return a * b
        case "tanh":
            return jnp.tanh(a)
        case "exp":
            return jnp.exp(jnp.tanh(a))  # bounded
        case "reshape":
            return a.reshape(op.param)
        case "transpose":
            return jnp.transpose(a, op.param)
        case "reduce_sum":
            return a.sum(axis=op.param[0]) / a.shape[op.param[0]]
        case "reduce_max":
            return a.max(axis=op.param[0])
        case "broadcast":
            return jnp.broadcast_to(a[None], (op.param[0], *a.shape))
        case "slice":
            axis, lo, hi = op.param
            return jax.lax.slice_in_dim(a, lo, hi, axis=axis)
        case "concatenate":
            return jnp.concatenate([a, b * 0.5], axis=op.param[0])
        case "stack":  # its gradient unstacks
            return jnp.stack([a, b * 0.5], axis=op.param[0])
        case "take":
            axis, n = op.param
            idx = (np.arange(n) * 5 + 1) % a.shape[axis]
            return jnp.take(a, jnp.asarray(idx, jnp.int32), axis=axis)
    raise AssertionError(op.name)


def build(program: Program):
    """The value-and-grad program of `loss = sum(result * w)` w.r.t. every input;
    its aux output is the program's result (the forward values)."""

    def f(*inputs):
        it, t = iter(inputs), []
        for op in program.steps:
            t.append(next(it) if op.name == "input" else _apply(op, t))
        out = t[-1]
        w = (jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape) % 7 - 3) / 4
        return jnp.sum(out * w), out

    argnums = tuple(range(len(program.inputs)))
    return jax.value_and_grad(f, argnums=argnums, has_aux=True)


def inputs_for(program: Program) -> list[jax.Array]:
    """Position-dependent, distinct values in [-0.5, 0.5) (no ties for reduce_max)."""
    out = []
    for k, shape in enumerate(program.inputs):
        n = math.prod(shape)
        v = (np.arange(n) * 37 + 11 * k) % n if n > 1 else np.zeros(1)
        out.append(jnp.asarray((v / max(n, 1) - 0.5).reshape(shape), jnp.float32))
    return out


@st.composite
def programs(draw) -> Program:
    dim = st.sampled_from(DIMS)
    first = tuple(draw(st.lists(dim, min_size=1, max_size=3)))
    steps: list[Op] = [Op("input", (), first)]
    shapes: list[tuple[int, ...]] = [first]

    def emit(op: Op, shape: tuple[int, ...]) -> int:
        steps.append(op)
        shapes.append(shape)
        return len(steps) - 1

    for _ in range(draw(st.integers(2, 7))):
        i = draw(st.integers(0, len(shapes) - 1))
        s = shapes[i]
        name = draw(st.sampled_from(OPS))
        if name == "dot":  # with an existing [k, n] tensor, or a new weight input
            same = [j for j, t in enumerate(shapes) if len(t) == 2 and t[0] == s[-1]]
            if same and draw(st.booleans()):
                j = draw(st.sampled_from(same))
            else:
                w = (s[-1], draw(dim))
                j = emit(Op("input", (), w), w)
            emit(Op(name, (i, j)), (*s[:-1], shapes[j][1]))
        elif name in ("add", "mul"):
            same = [j for j, t in enumerate(shapes) if t == s]
            emit(Op(name, (i, draw(st.sampled_from(same)))), s)
        elif name in ("tanh", "exp"):
            emit(Op(name, (i,)), s)
        elif name == "reshape":
            out = _reshaped(draw, s)
            emit(Op(name, (i,), out), out)
        elif name == "transpose":
            perm = tuple(draw(st.permutations(range(len(s)))))
            emit(Op(name, (i,), perm), tuple(s[p] for p in perm))
        elif name in ("reduce_sum", "reduce_max"):
            if len(s) > 1:  # keep tensors at least 1-d
                axis = draw(st.integers(0, len(s) - 1))
                emit(Op(name, (i,), (axis,)), s[:axis] + s[axis + 1 :])
        elif name == "broadcast":
            k = draw(dim)
            if len(s) < 3 and k * math.prod(s) <= MAX_SIZE:
                emit(Op(name, (i,), (k,)), (k, *s))
        elif name == "slice":
            axis = draw(st.integers(0, len(s) - 1))
            if s[axis] > 1:
                lo = draw(st.integers(0, s[axis] - 1))
                hi = draw(st.integers(lo + 1, s[axis]))
                emit(Op(name, (i,), (axis, lo, hi)), s[:axis] + (hi - lo,) + s[axis + 1 :])
        elif name == "concatenate":
            axis = draw(st.integers(0, len(s) - 1))
            fits = [
                j
                for j, t in enumerate(shapes)
                if len(t) == len(s) and all(t[d] == s[d] for d in range(len(s)) if d != axis)
            ]
            j = draw(st.sampled_from(fits))
            out = s[:axis] + (s[axis] + shapes[j][axis],) + s[axis + 1 :]
            if math.prod(out) <= MAX_SIZE:
                emit(Op(name, (i, j), (axis,)), out)
        elif name == "stack":
            axis = draw(st.integers(0, len(s)))
            same = [j for j, t in enumerate(shapes) if t == s]
            if len(s) < 3 and 2 * math.prod(s) <= MAX_SIZE:
                emit(
                    Op(name, (i, draw(st.sampled_from(same))), (axis,)), s[:axis] + (2,) + s[axis:]
                )
        else:  # take: a gather with constant indices
            axis, n = draw(st.integers(0, len(s) - 1)), draw(dim)
            emit(Op(name, (i,), (axis, n)), s[:axis] + (n,) + s[axis + 1 :])
    if steps[-1].name == "input":
        emit(Op("tanh", (len(steps) - 1,)), shapes[-1])
    return Program(tuple(steps))


def _reshaped(draw, s: tuple[int, ...]) -> tuple[int, ...]:
    """Merge two neighbouring dims, or split one into two factors."""
    merges = list(range(len(s) - 1))
    splits = [k for k, d in enumerate(s) if len(s) < 3 and (d % 2 == 0 or d % 3 == 0)]
    if merges and (not splits or draw(st.booleans())):
        k = draw(st.sampled_from(merges))
        return s[:k] + (s[k] * s[k + 1],) + s[k + 2 :]
    if not splits:
        return s
    k = draw(st.sampled_from(splits))
    f = 2 if s[k] % 2 == 0 else 3
    return s[:k] + (f, s[k] // f) + s[k + 1 :]


def check(program: Program, mesh: dict[str, int], engines=ENGINES) -> None:
    fn = build(program)
    args = inputs_for(program)
    want = jax.jit(fn)(*args)
    for engine in engines:
        got = autopar.parallelize(fn, mesh=mesh, engine=engine)(*args)
        assert_trees_close(got, want, rtol=1e-4, atol=1e-5, what=f"{program}\n{mesh} {engine}")


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@pytest.mark.slow  # the default run keeps test_random_plans_lower_exactly and the regressions
@given(programs(), st.sampled_from(MESHES))
def test_sharded_equals_unsharded(program, mesh):
    """Every engine on each program: MAX_EXAMPLES x len(ENGINES) sharded runs."""
    check(program, mesh)


# Shrunk failures worth keeping, and hand-picked corners (every op at least once).
REGRESSIONS = [
    (
        Program(
            (
                Op("input", (), (8, 12)),
                Op("input", (), (12, 16)),
                Op("dot", (0, 1)),
                Op("take", (2,), (1, 6)),
                Op("reduce_max", (3,), (0,)),
            )
        ),
        {"data": 2, "model": 4},
    ),
    (
        Program(
            (
                Op("input", (), (4, 6, 8)),
                Op("transpose", (0,), (2, 0, 1)),
                Op("reshape", (1,), (8, 24)),
                Op("slice", (2,), (1, 3, 19)),
                Op("concatenate", (3, 3), (0,)),
                Op("exp", (4,)),
            )
        ),
        {"a": 2, "b": 2, "c": 2},
    ),
    (  # RoPE's interleaved halves, as `jnp.stack` on a new last dim (its gradient unstacks)
        Program(
            (
                Op("input", (), (8, 16)),
                Op("input", (), (16, 12)),
                Op("dot", (0, 1)),
                Op("tanh", (2,)),
                Op("stack", (2, 3), (2,)),
                Op("reshape", (4,), (8, 24)),
                Op("stack", (5, 5), (0,)),
            )
        ),
        {"data": 2, "model": 4},
    ),
    (
        Program(
            (
                Op("input", (), (16,)),
                Op("broadcast", (0,), (12,)),
                Op("tanh", (1,)),
                Op("mul", (2, 1)),
                Op("reduce_sum", (3,), (1,)),
                Op("add", (4, 4)),
            )
        ),
        {"data": 8},
    ),
]


@pytest.mark.parametrize("program, mesh", REGRESSIONS)
def test_regressions(program, mesh):
    check(program, mesh)


def test_stack_and_unstack_are_split_like_their_operands():
    """RoPE written with `jnp.stack` (interleaved halves) and its gradient (`unstack`),
    in a data-parallel step: split over the batch like the ops around them, not run
    replicated (the rules of `strategies.shapes`; without them, no rule: each gathered
    its operand, an all-gather)."""
    import warnings

    def loss(w, x):
        h = x @ w
        y = jnp.stack([-h[:, 1::2], h[:, ::2]], axis=-1).reshape(h.shape)
        return jnp.sum(jnp.tanh(y) ** 2)

    def step(w, x):
        return w - 0.1 * jax.grad(loss)(w, x)

    x = jnp.asarray((np.arange(64 * 32) % 13 - 6) / 8, jnp.float32).reshape(64, 32)
    w = jnp.asarray((np.arange(32 * 16) % 7 - 3) / 9, jnp.float32).reshape(32, 16)
    fast = autopar.parallelize(step, mesh={"data": 8}, engine="data")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fast.plan(w, x)
    assert not [c for c in caught if "no sharding rule" in str(c.message)]
    ops = {op.op: op.strategy for op in plan.ops if op.op in ("stack", "unstack")}
    assert ops == {
        "stack": "S[data]RR = S[data]R x S[data]R",
        "unstack": "S[data]R, S[data]R = S[data]RR",
    }
    assert_trees_close(fast(w, x), jax.jit(step)(w, x), rtol=1e-5)
    hlo = fast.lower(w, x).compile().as_text()
    gathered = set(re.findall(r"= (f32\[[\d,]*\])\S* all-gather\(", hlo))
    assert gathered <= {"f32[32,16]"}, gathered  # at most the weight, stored split (ZeRO)


def random_plan(fn, args, mesh: dict[str, int], seed: int):
    """`fn` jitted under a random (valid) plan: every op a random strategy, half the
    time one that passes a partial sum through when the op has such variants."""
    import cost_models
    from autopar.api import make_plan
    from autopar.cost.model import CostModel
    from autopar.ir.capture import capture
    from autopar.lower.jit import jit_from_plan
    from autopar.meshes import make_mesh
    from autopar.search import SearchResult
    from autopar.search.evaluate import evaluate
    from autopar.search.problem import build_problem
    from autopar.sharding import mesh_info

    jmesh = make_mesh(mesh)
    profile = cost_models.load("h100-sxm")
    graph = capture(fn, args, (), jmesh)  # as parallelize does: under the mesh
    info = mesh_info(jmesh, profile.devices_per_node)
    problem = build_problem(graph, info, CostModel(profile, info))
    rng = np.random.default_rng(seed)
    choice = []
    for strategies in problem.strategies:
        passing = [k for k, s in enumerate(strategies) if any(p.partial for p in s.in_specs)]
        pool = passing if passing and rng.random() < 0.5 else range(len(strategies))
        choice.append(int(rng.choice(list(pool))))
    result = SearchResult(tuple(choice), "random", evaluate(problem, choice), 0.0, {})
    plan = make_plan(problem, result, profile, jmesh)
    return jit_from_plan(graph, plan, jmesh), plan


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs(), st.sampled_from(MESHES), st.integers(0, 2**16))
def test_random_plans_lower_exactly(program, mesh, seed):
    """The lowering is right for *any* plan, not only the ones the engines like:
    random strategies (partial sums passed through linear ops included)."""
    fn = build(program)
    args = inputs_for(program)
    want = jax.jit(fn)(*args)
    jitted, plan = random_plan(fn, args, mesh, seed)
    got = jax.tree.unflatten(jax.tree.structure(want), jitted(*jax.tree.leaves(args)))
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5, what=f"{program}\n{mesh} seed {seed}")
