"""Mixed precision as a graph pass: bfloat16 or float16 compute, float32 master weights.

`mixed_precision(graph)` returns a new `Graph` in which every contraction
(`dot_general`, `conv_general_dilated`) whose operands and result are float32
reads its operands cast to the compute dtype (fresh `convert_element_type`
nodes placed just before it) and accumulates and returns float32
(`preferred_element_type=float32`). Every other value keeps its type:
parameters, optimizer state, gradients, activations and the loss stay float32,
so the optimizer updates float32 master weights; only the matmuls and
convolutions run at the reduced-precision rate on reduced-precision operands.
Run it on the captured train step, after differentiation: the backward
contractions (gradients of activations and of weights) are converted like the
forward ones.

float16 needs scaling: its range (6e-8 to 65504) underflows small gradients and
overflows large activations. The classic remedy, loss scaling, multiplies the
loss before the backward pass; a captured step is already differentiated, so
the pass scales where the range matters instead, at each cast: an operand `x`
becomes `float16(x * 2**k)`, with `k` chosen from `max|x|` (read off its float32
exponent bits) so the largest element lands in [2**14, 2**15), and the
contraction's float32 result is multiplied back by `2**-(k_a + k_b)`. This is
per-tensor dynamic scaling ("current scaling", as FP8 training does): every
cotangent gets the scale loss scaling would have had to guess, activations that
exceed 65504 are scaled down rather than becoming inf, no scale state is carried
between steps and no step is skipped. Scaling by a power of two does not change
a float16 significand, so the only values that differ from an unscaled cast are
the ones it would have flushed to zero or to inf. The cost is one `max|x|`
reduction per operand (a scalar all-reduce where `x` is sharded), which the
search prices like any other op. The reductions are tagged (`RANGE_SCOPE` in
their name stack) so that micro-batch loops may compute them per micro-batch:
a micro-batch's scale differs from the whole batch's only in which tiny
elements reach float16's subnormal range (`autopar.passes.microbatch`).

Scan bodies (`Node.body`) and cond branches (`Node.branches`) are converted
recursively. Their inputs and outputs keep their types, so the node's interface
is unchanged; its `jaxpr` (`branches`) param is retraced from the converted
graphs so that binding the node computes what they say.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autopar.cost.model import node_flops
from autopar.errors import format_bytes
from autopar.ir.capture import append_traced
from autopar.ir.eval import bind_node, retrace
from autopar.ir.graph import Graph, Node, check_graph
from autopar.ir.ops import CONTRACTIONS

MASTER_DTYPE = np.dtype(np.float32)
F16 = np.dtype(jnp.float16)
SUPPORTED = (np.dtype(jnp.bfloat16), F16)
RANGE_SCOPE = "fp16_range_scale"  # name-stack tag of the float16 scaling ops
_TARGET_EXP = 14  # a scaled operand's largest magnitude lands in [2**14, 2**15)


def compute_dtype_of(dtype: Any) -> np.dtype:
    """The canonical compute dtype (bfloat16 or float16); others raise ValueError."""
    d = np.dtype(jnp.dtype(dtype))
    if d not in SUPPORTED:
        names = ", ".join(s.name for s in SUPPORTED)
        raise ValueError(f"mixed precision compute dtype must be one of: {names}; got {d.name}")
    return d


def is_range_scale(node: Node) -> bool:
    """Whether `node` belongs to a float16 operand's scale computation."""
    return node.name_stack.rsplit("/", 1)[-1] == RANGE_SCOPE


def scaled_cast(x):
    """float16(x * 2**k) with max|x| * 2**k in [2**14, 2**15), and 2**-k; k from the
    float32 exponent bits of max|x| (0, inf and nan give k = 126 or -114: harmless)."""
    amax = jnp.max(jnp.abs(x))
    exp = (lax.bitcast_convert_type(amax, jnp.int32) >> 23) - 127
    k = lax.clamp(jnp.int32(-126), jnp.int32(_TARGET_EXP) - exp, jnp.int32(126))
    scale = lax.bitcast_convert_type((k + 127) << 23, jnp.float32)
    inverse = lax.bitcast_convert_type((127 - k) << 23, jnp.float32)
    return (x * scale).astype(F16), inverse


def _unscaled(y, *inverses):
    scale = inverses[0]
    for inv in inverses[1:]:
        scale = scale * inv
    return y * scale


def converts(node: Node, graph: Graph) -> bool:
    """Whether `mixed_precision` converts `node`: a contraction whose operands and
    result are all float32 (and that does not ask for another accumulator type)."""
    if node.op not in CONTRACTIONS:
        return False
    types = [graph.values[v] for v in (*node.inputs, *node.outputs)]
    pref = node.params.get("preferred_element_type")
    return all(t.dtype == MASTER_DTYPE for t in types) and (
        pref is None or np.dtype(pref) == MASTER_DTYPE
    )


def mixed_precision(graph: Graph, compute_dtype: Any = jnp.bfloat16) -> Graph:
    """A new graph computing `graph` with float32 contractions in `compute_dtype`
    (operands cast, float32 accumulation and result); `graph` is not touched.

    New values are appended after the old ones (old value ids keep their meaning);
    nodes are renumbered in their new topological order, each cast sitting just
    before its contraction with the contraction's name stack and source line. A
    contraction gets its own casts (one per distinct operand), so the sharding
    search may split each use of a weight its own way. Graph inputs, outputs,
    paths, consts and trees are the same objects."""
    return _convert(graph, compute_dtype_of(compute_dtype))


def _convert(graph: Graph, dtype: np.dtype) -> Graph:
    values = list(graph.values)
    nodes: list[Node] = []
    consts = dict(graph.consts)
    for node in graph.nodes:
        if node.body is not None:
            body = _convert(node.body, dtype)
            if body is not node.body:
                node = replace(node, body=body, params=_with_body_jaxpr(node.params, body))
        if node.branches is not None:
            branches = tuple(_convert(b, dtype) for b in node.branches)
            if any(a is not b for a, b in zip(branches, node.branches)):
                node = replace(
                    node, branches=branches, params=_with_branch_jaxprs(node.params, branches)
                )
        if not converts(node, graph):
            nodes.append(replace(node, id=len(nodes)) if node.id != len(nodes) else node)
            continue
        if dtype == F16:
            _append_scaled(node, values, nodes, consts)
            continue
        cast = {  # one cast per distinct operand, with the contraction's location
            v: append_traced(
                values, nodes, consts, _cast_to(dtype.name), [v], node.name_stack, node.source
            )[0]
            for v in dict.fromkeys(node.inputs)
        }
        nodes.append(_mixed(node, len(nodes), tuple(cast[v] for v in node.inputs)))
    if len(values) == len(graph.values) and all(
        a is b for a, b in zip(nodes, graph.nodes, strict=True)
    ):
        return graph  # nothing to convert: the same (immutable) graph
    out = replace(graph, values=tuple(values), nodes=tuple(nodes), consts=consts)
    check_graph(out)
    return out


def _mixed(node: Node, node_id: int, inputs: tuple[int, ...], outputs=None) -> Node:
    """`node` reading `inputs` (reduced precision) and accumulating in float32."""
    return replace(
        node,
        id=node_id,
        inputs=inputs,
        outputs=node.outputs if outputs is None else outputs,
        params={**node.params, "preferred_element_type": MASTER_DTYPE},
    )


def _append_scaled(node: Node, values: list, nodes: list, consts: dict) -> None:
    """float16: each operand scaled into float16's range and cast, the contraction,
    then its float32 result scaled back into the original output value."""
    stack = f"{node.name_stack}/{RANGE_SCOPE}" if node.name_stack else RANGE_SCOPE
    cast: dict[int, tuple[int, int]] = {}
    for v in dict.fromkeys(node.inputs):
        q, inv = append_traced(values, nodes, consts, scaled_cast, [v], stack, node.source)
        cast[v] = (q, inv)
    (out,) = node.outputs
    values.append(values[out])
    raw = len(values) - 1
    nodes.append(_mixed(node, len(nodes), tuple(cast[v][0] for v in node.inputs), (raw,)))
    inverses = [cast[v][1] for v in node.inputs]
    (res,) = append_traced(
        values, nodes, consts, _unscaled, [raw, *inverses], node.name_stack, node.source
    )
    last = nodes[-1]
    assert last.outputs == (res,)
    nodes[-1] = replace(last, outputs=(out,))  # the result keeps the contraction's value id


@functools.cache
def _cast_to(dtype_name: str) -> Callable:
    """`x.astype(dtype_name)`, one function object per dtype (traces are cached by it)."""
    return lambda x: x.astype(dtype_name)


def _with_body_jaxpr(params: dict, body: Graph, upcast: bool = False) -> dict:
    """A scan's params with `jaxpr` retraced from `body` (same avals in and out)."""
    return {**params, "jaxpr": _retraced(params["jaxpr"], body, upcast)}


def _with_branch_jaxprs(params: dict, branches: tuple[Graph, ...], upcast: bool = False) -> dict:
    """A cond's params with each of `branches` retraced from its graph."""
    new = tuple(_retraced(j, b, upcast) for j, b in zip(params["branches"], branches))
    return {**params, "branches": new}


def _retraced(old, graph: Graph, upcast: bool):
    """The closed jaxpr of `graph`, on `old`'s argument avals; its results must be `old`'s."""
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in old.in_avals]
    new = jax.make_jaxpr(graph_fn(graph, upcast_contractions=upcast))(*args)
    if [(a.shape, a.dtype) for a in new.out_avals] != [(a.shape, a.dtype) for a in old.out_avals]:
        raise AssertionError("mixed_precision changed the result types of a loop body or branch")
    return new


def graph_fn(graph: Graph, *, upcast_contractions: bool = False) -> Callable[..., tuple]:
    """A function of the flat inputs that evaluates `graph` op by op, unsharded
    (`autopar.ir.eval.retrace`: a scan binds its `jaxpr` param).

    `upcast_contractions` runs converted contractions on float32 copies of their
    operands (`upcast_operands`): the same products, for XLA:CPU, whose unfused dot
    kernel rejects bfloat16 x bfloat16 -> float32."""
    return retrace(graph, _bind_upcast if upcast_contractions else bind_node)


def _bind_upcast(node: Node, invals: list) -> list:
    """`node` bound on `upcast_operands`, its scan body (cond branches) retraced so."""
    params = dict(node.params)
    if node.body is not None:
        params = _with_body_jaxpr(params, node.body, upcast=True)
    if node.branches is not None:
        params = _with_branch_jaxprs(params, node.branches, upcast=True)
    return bind_node(node, upcast_operands(node, invals), params)


def upcast_operands(node: Node, invals: list) -> list:
    """`invals` for binding `node`, with a reduced-precision contraction accumulating
    into float32 (what `mixed_precision` makes) given float32 copies of its operands.
    The same numbers up to float32 summation order: bfloat16 values are float32 values
    and their products are exact in float32. For backends that lack the mixed
    kernel (XLA:CPU's unfused dot: `Unsupported element type for DotThunk::Execute:
    BF16 x BF16 = F32`); on GPUs bind the node as it is, to run at the bfloat16 rate."""
    if node.op not in CONTRACTIONS or node.params.get("preferred_element_type") is None:
        return invals
    if np.dtype(node.params["preferred_element_type"]) != MASTER_DTYPE:
        return invals
    if not all(np.dtype(x.dtype) in SUPPORTED for x in invals):
        return invals
    return [jnp.asarray(x).astype(MASTER_DTYPE) for x in invals]


# --- what the pass does, for a plan's notes ------------------------------------------


@dataclass(frozen=True)
class Conversion:
    """One converted contraction. Per-call figures multiply by `executions` (the
    product of the enclosing scans' lengths)."""

    op: str
    key: str  # source line and name stack of the contraction
    scope: str  # "" at top level, else the enclosing scan bodies' keys, outermost first
    executions: int
    flops: float  # per execution
    operand_bytes: int  # float32 operand bytes per execution; the cast halves them

    @property
    def saved_bytes(self) -> int:
        """Operand bytes the contraction no longer reads, per execution."""
        return self.operand_bytes // 2


@dataclass(frozen=True)
class PrecisionReport:
    compute_dtype: str
    conversions: tuple[Conversion, ...]
    skipped: tuple[str, ...]  # contractions left alone: `key: reason`

    @property
    def converted(self) -> int:
        """Contraction nodes converted (a scan body's counted once)."""
        return len(self.conversions)

    @property
    def converted_per_call(self) -> int:
        return sum(c.executions for c in self.conversions)

    @property
    def flops(self) -> float:
        """FLOPs per call that now run at the compute dtype's rate."""
        return sum(c.flops * c.executions for c in self.conversions)

    @property
    def operand_bytes(self) -> int:
        """Bytes per call the converted contractions read as float32 operands before."""
        return sum(c.operand_bytes * c.executions for c in self.conversions)

    @property
    def saved_bytes(self) -> int:
        """Contraction operand bytes per call no longer read (half of `operand_bytes`)."""
        return sum(c.saved_bytes * c.executions for c in self.conversions)

    def notes(self, on_cpu: bool = False) -> tuple[str, ...]:
        """Lines for a plan's warnings/notes (`on_cpu`: the program runs on CPU devices)."""
        if not self.conversions:
            lines = [f"mixed precision ({self.compute_dtype}): no float32 contraction to convert"]
        else:
            lines = [
                f"mixed precision: {self.converted} contractions ({self.converted_per_call} "
                f"a call, {self.flops:.3g} FLOPs) compute in {self.compute_dtype} with float32 "
                f"accumulation; their operands read {format_bytes(self.saved_bytes)} less a call "
                f"({format_bytes(self.operand_bytes)} as float32)",
                "mixed precision: parameters, optimizer state, gradients, activations and the "
                f"loss stay float32 (master weights); the {self.compute_dtype} operand copies "
                "are extra, short-lived buffers",
            ]
            if self.compute_dtype == F16.name:
                lines.append(
                    "mixed precision: float16 operands are scaled into range, each by a power "
                    "of two from its own max|x| (in place of loss scaling), and the results "
                    "scaled back"
                )
        if self.conversions and on_cpu:
            lines.append(
                f"mixed precision: on CPU devices the {self.compute_dtype} operands are "
                "rounded and the contractions run in float32 (XLA:CPU has no "
                f"{self.compute_dtype} kernel that accumulates in float32): the numbers are "
                "a GPU's, the speed is not; the plan is priced at the cluster profile's rate"
            )
        if self.skipped:
            shown = "; ".join(self.skipped[:3]) + (" ..." if len(self.skipped) > 3 else "")
            lines.append(
                f"mixed precision: {len(self.skipped)} contractions kept as they are: {shown}"
            )
        return tuple(lines)

    def __str__(self) -> str:
        return "\n".join(self.notes())


def describe(graph: Graph, compute_dtype: Any = jnp.bfloat16) -> PrecisionReport:
    """What `mixed_precision(graph, compute_dtype)` converts; `graph` is the graph
    *before* the pass (the converted one has nothing left to convert)."""
    dtype = compute_dtype_of(compute_dtype)
    conversions: list[Conversion] = []
    skipped: list[str] = []

    def walk(g: Graph, scope: tuple[str, ...], executions: int) -> None:
        for node in g.nodes:
            if node.body is not None:
                walk(node.body, (*scope, node.key), executions * int(node.params["length"]))
            elif node.branches is not None:  # at most one branch runs
                for k, b in enumerate(node.branches):
                    walk(b, (*scope, f"{node.key} branch {k}"), executions)
            elif converts(node, g):
                conversions.append(
                    Conversion(
                        node.op,
                        node.key,
                        " > ".join(scope),
                        executions,
                        node_flops(node, g),
                        sum(g.values[v].nbytes for v in dict.fromkeys(node.inputs)),
                    )
                )
            elif node.op in CONTRACTIONS:
                types = ", ".join(str(g.values[v]) for v in (*node.inputs, *node.outputs))
                skipped.append(f"{node.key}: not all float32 ({types})")

    walk(graph, (), 1)
    return PrecisionReport(dtype.name, tuple(conversions), tuple(skipped))
