"""autopar's IR: a flat dataflow graph over a jaxpr, with stable names.

`capture.capture` builds a `Graph` from a function; every later pass reads it
and never mutates it. Values are numbered densely; node `i` is the i-th op in
topological order.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from autopar.sharding import hash_once

T = TypeVar("T")


@hash_once
@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: np.dtype  # what the value is priced and, where rebuilt, made as
    # the name of a JAX extended dtype (a typed PRNG key's `key<fry>`) the value has,
    # whose words `dtype` prices; "" for numpy dtypes
    extended: str = ""

    @property
    def dtype_name(self) -> str:
        """The dtype as the user's program has it: `float32`, ..., `key<fry>`."""
        return self.extended or self.dtype.name

    @property
    def rank(self) -> int:
        return len(self.shape)

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.name}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True, eq=False)
class Node:
    """One primitive application. `params`/`primitive` are kept for lowering."""

    id: int
    op: str  # primitive name
    inputs: tuple[int, ...]  # value ids
    outputs: tuple[int, ...]  # value ids
    primitive: Any = field(repr=False)
    params: Mapping[str, Any] = field(repr=False)
    name_stack: str = ""
    source: str = "<unknown>"  # the user's line (`ir.capture._source`)
    # `scan`: the loop body as its own graph (inputs: consts, carry, one slice of
    # each xs; outputs: carry, one slice of each ys), searched once for all steps
    body: Graph | None = field(default=None, repr=False)
    # `cond`: each branch as its own graph (inputs: the operands after the branch
    # index; outputs: the results), all searched to one interface
    branches: tuple[Graph, ...] | None = field(default=None, repr=False)
    # the library line (Flax, optax, ...) that made the op, when `source` is not it
    library_source: str = ""

    @property
    def key(self) -> str:
        """Human-readable location, `model.py:42 (h_3/mlp)`."""
        return f"{self.source} ({self.name_stack})" if self.name_stack else self.source


@dataclass(frozen=True, eq=False)
class Graph:
    """A captured function.

    values[i]    the type of value i
    consts       value id -> constant (jaxpr literals and closed-over arrays)
    inputs       value ids of the flattened (non-static) arguments
    outputs      value ids of the flattened results (may be inputs or consts)
    """

    values: tuple[TensorType, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[int, ...]
    input_paths: tuple[str, ...]
    outputs: tuple[int, ...]
    output_paths: tuple[str, ...]
    consts: Mapping[int, Any]
    in_tree: Any = field(repr=False, default=None)
    out_tree: Any = field(repr=False, default=None)
    name: str = "fn"

    @functools.cached_property
    def phase(self) -> tuple[int, ...]:
        """`phases(self)`, once: FORWARD, BACKWARD or OTHER per node."""
        return tuple(phases(self))

    @functools.cached_property
    def producer(self) -> dict[int, int]:
        """value id -> id of the node that produces it."""
        return {v: n.id for n in self.nodes for v in n.outputs}

    @functools.cached_property
    def consumers(self) -> dict[int, tuple[int, ...]]:
        """value id -> ids of the nodes that read it (each once, in order)."""
        out: dict[int, list[int]] = {}
        for n in self.nodes:
            for v in dict.fromkeys(n.inputs):
                out.setdefault(v, []).append(n.id)
        return {v: tuple(ns) for v, ns in out.items()}

    def memo(self, fn: Callable[[Graph], T]) -> T:
        """`fn(self)`, computed once per graph: `fn` must read nothing but the graph (a
        mesh-shape search builds a problem of one graph per shape)."""
        held = self.__dict__.setdefault("_memo", {})
        if fn not in held:
            held[fn] = fn(self)
        return held[fn]

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    def __str__(self) -> str:
        lines = [f"graph {self.name}: {len(self.inputs)} inputs, {len(self.nodes)} nodes"]
        for v, p in zip(self.inputs, self.input_paths):
            lines.append(f"  in  %{v}: {self.values[v]}  {p}")
        for n in self.nodes:
            outs = ", ".join(f"%{v}: {self.values[v]}" for v in n.outputs)
            ins = ", ".join(f"%{v}" for v in n.inputs)
            lines.append(f"  {outs} = {n.op}({ins})  # {n.key}")
        for v, p in zip(self.outputs, self.output_paths):
            lines.append(f"  out %{v}  {p}")
        return "\n".join(lines)


def check_graph(g: Graph) -> None:
    """Verify the invariants every pass relies on; raise ValueError if broken."""
    defined = set(g.inputs) | set(g.consts)
    for i, n in enumerate(g.nodes):
        if n.id != i:
            raise ValueError(f"node {i} has id {n.id}")
        for v in n.inputs:
            if v not in defined:
                raise ValueError(f"node {i} ({n.op}) reads %{v} before it is defined")
        for v in n.outputs:
            if v in defined:
                raise ValueError(f"value %{v} defined twice (node {i})")
            defined.add(v)
    for v in g.outputs:
        if v not in defined:
            raise ValueError(f"output %{v} is never defined")
    if len(g.inputs) != len(g.input_paths) or len(g.outputs) != len(g.output_paths):
        raise ValueError("paths do not match inputs/outputs")


def without_dead(g: Graph) -> Graph:
    """`g` without the ops none of whose results is used (ids renumbered), in loop bodies
    and branches too (their arguments and results as they are): what `jax.jit` drops
    before XLA sees the program. Ops with effects (`_has_effects`) stay. Applied where a
    pass writes ops it may not need (`passes.roll`, `passes.remat`), not to every
    capture: `recursive`'s latency bar (`search.engines._latency_bound`) sits on the
    bucket share, which the dead sums of a step change (on a 64-wide GPT layer dropping
    them took `recursive` from 1.06x the ILP optimum to 15x)."""
    live = set(g.outputs)
    keep: list[Node] = []
    for n in reversed(g.nodes):
        if any(v in live for v in n.outputs) or _has_effects(n):
            body = without_dead(n.body) if n.body is not None else None
            branches = tuple(map(without_dead, n.branches)) if n.branches else n.branches
            if body is not n.body or any(map(operator.is_not, branches or (), n.branches or ())):
                n = replace(n, body=body, branches=branches)
            keep.append(n)
            live.update(n.inputs)
    if len(keep) == len(g.nodes) and all(a is b for a, b in zip(keep, reversed(g.nodes))):
        return g
    out = replace(g, nodes=tuple(replace(n, id=i) for i, n in enumerate(reversed(keep))))
    check_graph(out)
    return out


# Primitives run for their effects (`jax.debug.print`/`callback`, `io_callback`), by name:
# a jaxpr's effects are not kept on a Node.
_EFFECT_OPS = re.compile(r"callback|print")


def _has_effects(n: Node) -> bool:
    """Whether `n` (or an op in its body or branches) may run for its effects."""
    if not n.outputs or _EFFECT_OPS.search(n.op):
        return True
    inner = ([n.body] if n.body is not None else []) + list(n.branches or ())
    return any(_has_effects(m) for b in inner for m in b.nodes)


def body_path(role: str, k: int) -> str:
    """The path of a loop body's `k`-th argument or result of `role` (`const`, `carry`,
    `x` in; `carry`, `y` out): `body/carry0` in and out, so the search keeps each carry
    in one spec, like updated state."""
    return f"body/{role}{k}"


_BODY_PATH = re.compile(r"^body/(?:const|carry|x|y)\d+$")


def is_body_path(path: str) -> bool:
    """Whether `path` names a loop body's argument or result by its role (`body_path`):
    a position in the loop, not a layer index or any name of the user's."""
    return bool(_BODY_PATH.match(path))


FORWARD, BACKWARD, OTHER = 0, 1, 2  # `phases`


def phases(graph: Graph) -> list[int]:
    """FORWARD, BACKWARD or OTHER (the optimizer) per node, from the wrappers JAX writes
    into name stacks under `grad`: a function without `transpose(` is all forward."""
    if not any("transpose(" in n.name_stack for n in graph.nodes):
        return [FORWARD] * len(graph.nodes)
    return [
        BACKWARD if "transpose(" in n.name_stack else FORWARD if "jvp(" in n.name_stack else OTHER
        for n in graph.nodes
    ]


def find_aliases(graph: Graph) -> dict[int, int]:
    """Outputs that are updated versions of inputs: the same path below the argument
    name (`state/params/w` ~ `out/0/params/w`, `out/params/w`, or NNX's `out/1/0/w` for
    the first node's new state) and the same type: the longest tail of the output's
    path that some input's path below its argument name equals, of those the one input
    of the output's type (`step(w, x) -> (w - g, loss)`: both arguments are bare
    arrays, `w` alone has the new `w`'s type). Unique matches only."""
    by_rest: dict[str, list[int]] = {}
    for i, p in enumerate(graph.input_paths):
        by_rest.setdefault(p.partition("/")[2], []).append(i)
    aliases: dict[int, int] = {}
    for o, p in enumerate(graph.output_paths):
        comps = p.split("/")[1:]
        # longest tail first; the empty one (a bare array argument) only for `out`, `out/0`
        tails = ["/".join(comps[k:]) for k in range(len(comps))] + [""] * (len(comps) <= 1)
        cands: list[int] = []
        t = graph.values[graph.outputs[o]]
        for tail in tails:  # (`out/0` of `(frozen, lora)`: not `lora/0`, of another type)
            cands = [i for i in by_rest.get(tail, []) if graph.values[graph.inputs[i]] == t]
            if cands:
                break
        if len(cands) == 1 and cands[0] not in aliases.values():
            aliases[o] = cands[0]
    return aliases


_SIMPLE = (bool, int, float, str, type(None))


def _simple(v) -> bool:
    """Whether a primitive param is plain data (axes, dimension numbers, flags), which
    tells ops apart, rather than a function or jaxpr."""
    return all(map(_simple, v)) if type(v) is tuple else type(v) in _SIMPLE


def signature(graph: Graph, node: Node) -> tuple:
    """An op's structure: primitive, operand and result types, plain-data params; two
    layers' ops with equal signatures compute the same function of their operands."""
    vals = graph.values
    return (
        node.op,
        tuple(vals[v] for v in node.inputs),
        tuple(vals[v] for v in node.outputs),
        tuple((k, v) for k, v in node.params.items() if _simple(v)),
    )


def upstream(graph: Graph, values) -> set[int]:
    """The ids of the nodes `values` are computed from."""
    producer = graph.producer
    seen: set[int] = set()
    todo = [producer[v] for v in values if v in producer]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += [producer[v] for v in graph.nodes[n].inputs if v in producer]
    return seen
