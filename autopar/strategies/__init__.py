"""Strategy rules: for every node, the ways it can be sharded.

JAX-pass style: a registry from primitive name to a rule, a default, and one
generic enumerator. Most rules only *describe* an op as an einsum over
factors (`FactorRule`); `enumerate_factor_rule` turns the description into
every placement of mesh axes on factors, DTensor's einsum-strategy idea:

* a factor shared by inputs and outputs (batch, free dims): sharding it
  shards every tensor that carries it, nobody communicates;
* a reduction factor (only in inputs, e.g. the contracting dim `k` of
  `b m k, b k n -> b m n`): sharding it leaves the outputs Partial over those
  axes, to be summed later (the edge pays all-reduce or reduce-scatter);
* a dim with no factor (`None`) must be replicated.

`FactorRule.einsum("bmk,bkn->bmn", lhs_shape, rhs_shape)` writes a rule whose
every dim has a factor as that string.

Each mesh axis goes to at most one factor; a factor may take several axes.
Unknown primitives get the replicated strategy and a warning.
"""

from __future__ import annotations

import functools
import itertools
import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.ir.graph import Graph, Node
from autopar.sharding import MeshInfo, Spec


@dataclass(frozen=True)
class Factor:
    size: int
    reduce: bool = False  # in no output: sharding it makes the outputs Partial
    name: str = ""


@dataclass(frozen=True)
class FactorRule:
    """Einsum-like description: per input/output dim, the factor index or None."""

    factors: tuple[Factor, ...]
    in_dims: tuple[tuple[int | None, ...], ...]
    out_dims: tuple[tuple[int | None, ...], ...]

    @classmethod
    def einsum(cls, spec: str, *shapes: Sequence[int]) -> FactorRule:
        """The rule written as DTensor writes it, e.g. ``"bmk,bkn->bmn"``: one term per
        operand and per result, one letter per dim, each letter one factor; a letter in
        no result is contracted (sharding it leaves the results Partial). `shapes` are
        the operands' shapes, then optionally the results' (needed for a letter only
        results name). Spaces are ignored; an empty left side names no operand (an op
        with no inputs), an empty result term a scalar. Every dim has a factor (no
        `None`), and a letter appears at most once per term.

        Factors are numbered as the results name them, left to right, then the
        contracted letters alphabetically (a-z, then A-Z), so the strategies come out
        in a fixed order. Raises ValueError on a malformed `spec` or shapes that do not
        fit it."""
        text = "".join(spec.split())
        if text.count("->") != 1:
            raise ValueError(f"einsum rule {spec!r}: needs exactly one '->'")
        lhs, rhs = text.split("->")
        ins = lhs.split(",") if lhs else []
        outs = rhs.split(",")
        for term in (*ins, *outs):
            bad = sorted({c for c in term if c not in _LETTERS})
            if bad:
                raise ValueError(f"einsum rule {spec!r}: {bad} are not letters (a-z, A-Z)")
            if len(set(term)) != len(term):
                raise ValueError(f"einsum rule {spec!r}: term {term!r} repeats a letter")
        if len(shapes) not in (len(ins), len(ins) + len(outs)):
            raise ValueError(
                f"einsum rule {spec!r}: {len(shapes)} shapes for {len(ins)} operands "
                f"and {len(outs)} results (give the operands', then optionally the results')"
            )
        size: dict[str, int] = {}
        for term, shape in zip((*ins, *outs), shapes):
            if len(term) != len(shape):
                raise ValueError(f"einsum rule {spec!r}: term {term!r} for a shape {tuple(shape)}")
            for c, n in zip(term, shape):
                if size.setdefault(c, int(n)) != n:
                    raise ValueError(f"einsum rule {spec!r}: {c!r} is {size[c]} and {n}")
        kept = list(dict.fromkeys("".join(outs)))
        unsized = [c for c in kept if c not in size]
        if unsized:
            raise ValueError(f"einsum rule {spec!r}: no shape gives the size of {unsized}")
        summed = sorted({c for term in ins for c in term} - set(kept), key=_LETTERS.index)
        order = {c: i for i, c in enumerate(kept + summed)}
        return cls(
            tuple(Factor(size[c], reduce=c in summed, name=c) for c in order),
            tuple(tuple(order[c] for c in term) for term in ins),
            tuple(tuple(order[c] for c in term) for term in outs),
        )


_LETTERS = string.ascii_letters  # einsum letters, in the order contracted ones are numbered


@dataclass(frozen=True)
class Fixed:
    """A rule that allows exactly these specs (user constraints, opaque ops)."""

    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    label: str = "fixed"
    warning: str | None = None  # reported in the plan (e.g. control flow run replicated)


@dataclass(frozen=True)
class Strategy:
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    # per mesh axis: the factor it shards, None, or linear.PARTIAL (a passed-through sum)
    assignment: tuple[int | None, ...]
    parallel: int  # ways the op's work is divided
    label: str = ""  # a fixed rule's (a user constraint, an opaque op)

    @functools.cached_property
    def name(self) -> str:
        """`S[data]R = S[data]R x RS[model]`: the outputs' specs from the inputs' (made
        when asked: a 3-axis build enumerates ~10^5 strategies, the plan names a few)."""
        shown = [str(s) for s in self.in_specs if s.dims]
        name = f"{', '.join(map(str, self.out_specs))} = {' x '.join(shown) if shown else '()'}"
        return f"{name} ({self.label})" if self.label else name

    def __str__(self) -> str:
        return self.name


Rule = Callable[[Node, Graph], "FactorRule | Fixed | None"]
RULES: dict[str, Rule] = {}


def register(*names: str) -> Callable[[Rule], Rule]:
    def deco(rule: Rule) -> Rule:
        for n in names:
            RULES[n] = rule
        return rule

    return deco


def enumerate_factor_rule(rule: FactorRule, mesh: MeshInfo) -> list[Strategy]:
    """Every placement of mesh axes on the rule's factors that divides evenly. An axis of
    size 1 shards nothing and is never placed (a spec naming it would only differ in name
    from the one that does not, and could add collectives over a single device)."""
    n_f = len(rule.factors)
    out: list[Strategy] = []
    choices = [[None] if mesh.size(a) == 1 else [None, *range(n_f)] for a in mesh.axis_names]
    for assignment in itertools.product(*choices):
        axes_of: list[list[str]] = [[] for _ in range(n_f)]
        for axis, f in zip(mesh.axis_names, assignment):
            if f is not None:
                axes_of[f].append(axis)
        if any(
            axes and rule.factors[f].size % math.prod(mesh.size(a) for a in axes)
            for f, axes in enumerate(axes_of)
        ):
            continue
        partial = tuple(a for f, axes in enumerate(axes_of) if rule.factors[f].reduce for a in axes)

        ins = tuple(_spec(d, axes_of) for d in rule.in_dims)
        outs = tuple(_spec(d, axes_of, partial) for d in rule.out_dims)
        parallel = math.prod(mesh.size(a) for axes in axes_of for a in axes)
        out.append(Strategy(ins, outs, tuple(assignment), parallel))
    return out


def _spec(
    dims: tuple[int | None, ...], axes_of: list[list[str]], partial: tuple[str, ...] = ()
) -> Spec:
    return Spec(tuple(() if f is None else tuple(axes_of[f]) for f in dims), partial)


def fixed_strategy(rule: Fixed) -> Strategy:
    return Strategy(rule.in_specs, rule.out_specs, (), 1, rule.label)


def replicated_rule(node: Node, graph: Graph, label: str, warning: str | None = None) -> Fixed:
    return Fixed(
        tuple(Spec.replicated(graph.values[v].rank) for v in node.inputs),
        tuple(Spec.replicated(graph.values[v].rank) for v in node.outputs),
        label,
        warning,
    )


def _fit_to_mesh(rule: Fixed, node: Node, graph: Graph, mesh: MeshInfo) -> tuple[Fixed, str | None]:
    """Check a fixed rule (a user constraint) against the mesh: unknown axes are an
    error naming the source line; axes that do not divide a dim are dropped (as jax.jit
    would pad, autopar keeps every shard even) with a warning."""
    from autopar.errors import MeshError

    specs = (*rule.in_specs, *rule.out_specs)
    unknown = sorted({a for s in specs for a in s.used_axes if a not in mesh.axis_names})
    if unknown:
        raise MeshError(
            f"the sharding constraint at {node.key} names mesh axes {unknown}, but autopar plans on "
            f"mesh axes {mesh.axis_names}; constrain with this mesh's axes (bare PartitionSpecs "
            "resolve against the mesh given to autopar.parallelize)"
        )
    types = [graph.values[v] for v in (*node.inputs, *node.outputs)]
    dropped: list[str] = []

    def fit(spec: Spec, t) -> Spec:
        dims = []
        for size, axes in zip(t.shape, spec.dims):
            n = math.prod(mesh.size(a) for a in axes)
            if axes and size % n:
                dropped.append(f"dim of size {size} over {'x'.join(axes)} ({n})")
                axes = ()
            dims.append(axes)
        return Spec(tuple(dims), spec.partial)

    fitted = [fit(s, t) for s, t in zip(specs, types)]
    if not dropped:
        return rule, None
    k = len(rule.in_specs)
    note = (
        f"the sharding constraint at {node.key} on {types[0]} does not divide evenly "
        f"({'; '.join(dict.fromkeys(dropped))}); those dims run unsplit"
    )
    return Fixed(tuple(fitted[:k]), tuple(fitted[k:]), rule.label, rule.warning), note


@dataclass(frozen=True)
class NodeStrategies:
    strategies: tuple[Strategy, ...]
    warning: str | None = None  # set when the primitive has no rule


def strategies_for(node: Node, graph: Graph, mesh: MeshInfo) -> NodeStrategies:
    """All candidate strategies of `node` on `mesh` (never empty)."""
    from autopar.strategies import rules  # noqa: F401  (registers the rules)
    from autopar.strategies.linear import partial_variants

    rule_fn = RULES.get(node.op)
    warning = None
    rule = rule_fn(node, graph) if rule_fn is not None else None
    if rule is None:
        rule = replicated_rule(node, graph, "replicated: no rule")
        if rule_fn is None:
            warning = (
                f"no sharding rule for primitive '{node.op}' at {node.key}; it runs replicated"
            )
    if isinstance(rule, Fixed):
        rule, note = _fit_to_mesh(rule, node, graph, mesh)
        return NodeStrategies((fixed_strategy(rule),), warning or rule.warning or note)
    strategies = enumerate_factor_rule(rule, mesh)
    strategies += partial_variants(node, graph, mesh, strategies)
    return NodeStrategies(tuple(strategies), warning)
