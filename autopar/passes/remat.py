"""Rematerialization as a graph pass: recompute a layer loop's residuals backward.

A differentiated train step whose layers run under `scan` has two loops over the
layers: the forward scan emits, besides its carry, per-layer *residuals* as `ys`
(stacked `[L, ...]`: activations, softmax weights, layer-norm statistics) that
the backward scan (a later node, opposite direction, same length) reads as `xs`.
Those stacks live from the forward loop to the backward one and dominate the
step's activation memory. `remat(graph, policy)` returns a graph that stores
fewer of them and recomputes the rest inside the backward body, with copies of
the forward body's ops that produce them (only the ops needed):

- `"none"`: `graph` itself.
- `"full"`: the forward scan stores only each layer's input carry (a new `ys`
  when it did not already store it); the backward body recomputes every other
  residual from it, the layer's weights (the forward `xs`, already graph values)
  and the forward's loop constants (as new backward consts).
- `"dots"`: like `jax.checkpoint_policies.dots_saveable`: residuals that are
  outputs of `dot_general`/`conv_general_dilated` stay stored (and a contraction
  output that a recomputed residual needs becomes a new stored `ys`, so the
  backward never repeats a contraction); the elementwise, softmax and
  layer-norm intermediates are recomputed from them and the layer input.
- `"selective"`: like `"dots"`, but the contraction outputs that are cheapest to
  recompute per stored byte (`cheapest_contractions`: those whose FLOPs per output
  byte are the body's minimum) are recomputed too. In a transformer layer these are
  the attention scores `q @ k^T` ([B, heads, S, S]: 2 d_head FLOPs an element,
  against 2 S or more for every other matmul output), so this is Korthikanti et
  al.'s selective recomputation: the attention core is recomputed, the linear
  layers' outputs are kept.

Pairs: a backward scan `xs` input that is exactly a `ys` output of an earlier
forward scan of the same length with the opposite `reverse` flag (`scan_pairs`);
several pairs are handled one after the other. A residual that something else
also reads (another node, a graph output) stays stored. Scan bodies that hold
loops of their own are rewritten recursively.

The result computes the same numbers (the same ops on the same values), keeps
the function's inputs, outputs and node ids, and appends new values after the
old ones (a dropped residual's value id is left without a producer). Each
modified scan's `num_consts` (and `linear`, if present) is resized, its body's
paths renumbered, and its `jaxpr` retraced from the new body (`autopar.ir.eval.retrace`,
as `autopar.passes.precision` does), so binding the node computes what `Node.body` says.
The rewritten forward scan also drops the `ys` nothing reads, and its body the ops
only dropped values needed.

Not handled: layers unrolled in Python (no `scan` to pair: the graph comes back
unchanged); loops captured as `while`; residuals read as a backward *const*
(the whole stack) rather than per layer. Recomputed ops are assumed pure and
deterministic (a random op keyed by its inputs is; an effectful one is not).
`remat_report` prices the change: stored residual bytes before/after and the
backward FLOPs added (`autopar.cost.model.node_flops`); `choose_policy` picks the
cheapest policy whose residuals fit a byte budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from autopar.cost.model import node_flops
from autopar.ir.eval import retrace
from autopar.ir.graph import Graph, Node, TensorType, body_path, check_graph, without_dead
from autopar.ir.ops import CONTRACTIONS
from autopar.passes.remat_report import PairRemat, RematReport
from autopar.passes.remat_unrolled import (
    POLICIES,
    cheapest_contractions,
    remat_layers,
)
from autopar.passes.stack_misses import why_no_stack
from autopar.passes.stacks import find_stacks

# POLICIES, from most to least memory, are spelled once in remat_unrolled
SAVEABLE = CONTRACTIONS


# --- the scan's interface --------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a scan node's (and its body's) flat inputs and outputs split by role."""

    num_consts: int
    num_carry: int
    num_xs: int
    num_ys: int

    @staticmethod
    def of(node: Node) -> Layout:
        p = node.params
        n_c, n_carry = int(p["num_consts"]), int(p["num_carry"])
        return Layout(n_c, n_carry, len(node.inputs) - n_c - n_carry, len(node.outputs) - n_carry)

    @property
    def xs_start(self) -> int:
        return self.num_consts + self.num_carry

    def role_in(self, i: int) -> tuple[str, int]:
        """Input position -> (`const` | `carry` | `x`, index within the role)."""
        if i < self.num_consts:
            return "const", i
        if i < self.xs_start:
            return "carry", i - self.num_consts
        return "x", i - self.xs_start

    def input_paths(self) -> tuple[str, ...]:
        return (
            *(body_path("const", k) for k in range(self.num_consts)),
            *(body_path("carry", k) for k in range(self.num_carry)),
            *(body_path("x", k) for k in range(self.num_xs)),
        )

    def output_paths(self) -> tuple[str, ...]:
        return (
            *(body_path("carry", k) for k in range(self.num_carry)),
            *(body_path("y", k) for k in range(self.num_ys)),
        )


@dataclass(frozen=True)
class ScanPair:
    """A forward scan whose `ys` the backward scan reads as `xs` (node ids)."""

    forward: int
    backward: int
    reads: tuple[tuple[int, int], ...]  # (backward xs index, forward ys index)


def is_scan(node: Node) -> bool:
    return node.op == "scan" and node.body is not None


def scan_pairs(graph: Graph) -> tuple[ScanPair, ...]:
    """Every (forward, backward) scan pair of `graph`'s top level, in backward order."""
    pairs: list[ScanPair] = []
    for b in graph.nodes:
        if not is_scan(b):
            continue
        lb = Layout.of(b)
        reads: dict[int, list[tuple[int, int]]] = {}
        for j, v in enumerate(b.inputs[lb.xs_start :]):
            f = graph.nodes[graph.producer[v]] if v in graph.producer else None
            if f is None or not is_scan(f) or not _opposite(f, b):
                continue
            k = f.outputs.index(v) - Layout.of(f).num_carry
            if k >= 0:
                reads.setdefault(f.id, []).append((j, k))
        pairs.extend(ScanPair(f, b.id, tuple(r)) for f, r in sorted(reads.items()))
    return tuple(pairs)


def _opposite(f: Node, b: Node) -> bool:
    return (
        f.id < b.id
        and int(f.params["length"]) == int(b.params["length"])
        and bool(f.params["reverse"]) != bool(b.params["reverse"])
    )


# --- the pass ----------------------------------------------------------------------------


def remat(graph: Graph, policy: str) -> Graph:
    """`graph` with the residuals of each forward/backward scan pair rematerialized
    under `policy` (see the module docstring); `graph` itself when nothing changes."""
    if policy not in POLICIES:
        raise ValueError(f"remat policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "none":
        return graph
    out = _rewrite_bodies(graph, policy)
    for pair in scan_pairs(out):
        out = _rewrite_pair(out, pair.forward, pair.backward, policy)
    if out is not graph:
        check_graph(out)
    return out


def _rewrite_bodies(graph: Graph, policy: str) -> Graph:
    """Pairs nested inside scan bodies (the body's interface is unchanged)."""
    nodes = list(graph.nodes)
    for i, n in enumerate(nodes):
        if is_scan(n):
            body = remat(n.body, policy)
            if body is not n.body:
                nodes[i] = replace(n, body=body, params=_retraced(n, body, _weak_types(n)))
    if all(a is b for a, b in zip(nodes, graph.nodes)):
        return graph
    return replace(graph, nodes=tuple(nodes))


@dataclass(frozen=True)
class _Source:
    """Where the backward body finds a forward body value it needs (a boundary of the
    recomputation): a forward input, a forward literal, or a stored per-layer value."""

    kind: str  # "const" (forward const input), "x" (forward xs input), "literal", "stored"
    index: int = -1  # the forward input position ("const", "x")


def _saved(fb: Graph, policy: str) -> frozenset[int]:
    """Forward body values `policy` stores besides the layer input."""
    if policy not in ("dots", "selective"):
        return frozenset()
    dots = frozenset(v for n in fb.nodes if n.op in SAVEABLE for v in n.outputs)
    return dots - cheapest_contractions(fb) if policy == "selective" else dots


def _boundary(v: int, fb: Graph, lf: Layout, saved: frozenset[int]) -> _Source | None:
    """How forward body value `v` reaches the backward body without recomputing it
    (`saved`: the stored values besides the layer input); None: recompute it from its
    producer's inputs."""
    if v in fb.consts:
        return _Source("literal")
    if v in fb.inputs:
        i = fb.inputs.index(v)
        role, _ = lf.role_in(i)
        return _Source("stored") if role == "carry" else _Source(role, i)
    if v in saved:
        return _Source("stored")
    return None


def _rewrite_pair(graph: Graph, f_id: int, b_id: int, policy: str) -> Graph:
    f, b = graph.nodes[f_id], graph.nodes[b_id]
    fb = f.body
    lf, lb = Layout.of(f), Layout.of(b)
    reads = next(p.reads for p in scan_pairs(graph) if (p.forward, p.backward) == (f_id, b_id))
    fb_ys = fb.outputs[lf.num_carry :]
    saved = _saved(fb, policy)

    def only_backward(k: int) -> bool:
        v = f.outputs[lf.num_carry + k]
        return graph.consumers.get(v) == (b_id,) and v not in graph.outputs

    def recomputed(k: int) -> bool:  # a stored boundary (layer input, dot) stays stored
        s = _boundary(fb_ys[k], fb, lf, saved)
        return only_backward(k) and (s is None or s.kind != "stored")

    dropped = {k for _, k in reads if recomputed(k)}
    if not dropped:
        return graph
    recompute = {j: fb_ys[k] for j, k in reads if k in dropped}  # backward xs -> forward value
    needed, frontier = _closure(fb, recompute.values(), lambda v: _boundary(v, fb, lf, saved))

    # forward: keep the undropped ys, store the frontier values that are not stored yet
    def unused(k: int) -> bool:  # a ys nothing reads (jax's DropVar): dropped too
        v = f.outputs[lf.num_carry + k]
        return v not in graph.consumers and v not in graph.outputs

    kept = [k for k in range(lf.num_ys) if k not in dropped and not unused(k)]
    stored_at = {fb_ys[k]: f.outputs[lf.num_carry + k] for k in kept}
    values = list(graph.values)
    new_ys: list[int] = []  # forward body values stored anew
    for v, s in frontier.items():
        if s.kind == "stored" and v not in stored_at:
            t = fb.values[v]
            values.append(TensorType((int(f.params["length"]), *t.shape), t.dtype, t.extended))
            stored_at[v] = len(values) - 1
            new_ys.append(v)
    new_fb = without_dead(
        replace(
            fb,
            outputs=(*fb.outputs[: lf.num_carry], *(fb_ys[k] for k in kept), *new_ys),
            output_paths=replace(lf, num_ys=len(kept) + len(new_ys)).output_paths(),
        )
    )
    new_f = replace(
        f,
        outputs=(
            *f.outputs[: lf.num_carry],
            *(f.outputs[lf.num_carry + k] for k in kept),
            *(stored_at[v] for v in new_ys),
        ),
        body=new_fb,
    )
    new_f = replace(new_f, params=_retraced(new_f, new_fb, _weak_types(f)))

    # backward: its inputs, then the recomputation, then its own ops
    new_b = _backward(b, lb, f, frontier, stored_at, needed, recompute)
    nodes = list(graph.nodes)
    nodes[f_id], nodes[b_id] = new_f, new_b
    return replace(graph, values=tuple(values), nodes=tuple(nodes))


def _closure(
    fb: Graph, wanted: Iterable[int], boundary
) -> tuple[tuple[Node, ...], dict[int, _Source]]:
    """The forward body nodes that recompute `wanted` (in body order) and the
    boundary values they start from (value -> its `_Source`)."""
    needed: set[int] = set()
    frontier: dict[int, _Source] = {}
    stack = list(dict.fromkeys(wanted))
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        s = boundary(v)
        if s is not None:
            frontier[v] = s
            continue
        n = fb.producer[v]
        if n not in needed:
            needed.add(n)
            stack.extend(fb.nodes[n].inputs)
    return tuple(fb.nodes[i] for i in sorted(needed)), dict(sorted(frontier.items()))


def _backward(
    b: Node,
    lb: Layout,
    f: Node,
    frontier: Mapping[int, _Source],
    stored_at: Mapping[int, int],
    needed: Sequence[Node],
    recompute: Mapping[int, int],
) -> Node:
    """The backward scan node reading the frontier, and its body that recomputes the
    dropped residuals (backward xs index -> forward body value) before its own ops."""
    fb, bb = f.body, b.body
    dropped_xs = set(recompute)
    values = list(bb.values)
    consts = dict(bb.consts)
    b_consts = list(b.inputs[: lb.num_consts])
    b_xs = [v for j, v in enumerate(b.inputs[lb.xs_start :]) if j not in dropped_xs]
    body_consts = list(bb.inputs[: lb.num_consts])
    body_xs = [v for j, v in enumerate(bb.inputs[lb.xs_start :]) if j not in dropped_xs]
    f_weak, b_weak = _weak_types(f), _weak_types(b)
    weak_consts = list(b_weak[: lb.num_consts])
    weak_xs = [w for j, w in enumerate(b_weak[lb.xs_start :]) if j not in dropped_xs]

    def fresh(t: TensorType) -> int:
        values.append(t)
        return len(values) - 1

    env: dict[int, int] = {}  # forward body value -> backward body value
    for v, s in frontier.items():
        if s.kind == "literal":
            env[v] = fresh(fb.values[v])
            consts[env[v]] = fb.consts[v]
        elif s.kind == "const":
            outer = f.inputs[s.index]
            if outer not in b_consts:
                b_consts.append(outer)
                body_consts.append(fresh(fb.values[v]))
                weak_consts.append(f_weak[s.index])
            env[v] = body_consts[b_consts.index(outer)]
        else:  # a per-layer slice: a forward xs, or a stored forward ys
            outer = f.inputs[s.index] if s.kind == "x" else stored_at[v]
            if outer not in b_xs:
                b_xs.append(outer)
                body_xs.append(fresh(fb.values[v]))
                weak_xs.append(f_weak[s.index] if s.kind == "x" else False)
            env[v] = body_xs[b_xs.index(outer)]

    nodes: list[Node] = []
    for n in needed:
        for v in n.outputs:
            env[v] = fresh(fb.values[v])
        nodes.append(
            replace(
                n,
                id=len(nodes),
                inputs=tuple(env[v] for v in n.inputs),
                outputs=tuple(env[v] for v in n.outputs),
            )
        )
    old_xs = bb.inputs[lb.xs_start :]
    sub = {old_xs[j]: env[v] for j, v in recompute.items()}
    read = lambda v: sub.get(v, v)
    for n in bb.nodes:
        nodes.append(replace(n, id=len(nodes), inputs=tuple(map(read, n.inputs))))

    layout = replace(lb, num_consts=len(b_consts), num_xs=len(b_xs))
    body_carry = bb.inputs[lb.num_consts : lb.xs_start]
    new_bb = replace(
        bb,
        values=tuple(values),
        nodes=tuple(nodes),
        inputs=(*body_consts, *body_carry, *body_xs),
        input_paths=layout.input_paths(),
        outputs=tuple(map(read, bb.outputs)),
        consts=consts,
    )
    check_graph(new_bb)
    carry = b.inputs[lb.num_consts : lb.xs_start]
    new_b = replace(b, inputs=(*b_consts, *carry, *b_xs), body=new_bb)
    weak = (*weak_consts, *b_weak[lb.num_consts : lb.xs_start], *weak_xs)
    params = {**_retraced(new_b, new_bb, weak), "num_consts": layout.num_consts}
    if "linear" in params:
        params["linear"] = (False,) * len(new_b.inputs)
    return replace(new_b, params=params)


def _weak_types(node: Node) -> tuple[bool, ...]:
    return tuple(bool(getattr(a, "weak_type", False)) for a in node.params["jaxpr"].in_avals)


def _retraced(node: Node, body: Graph, weak: Sequence[bool]) -> dict[str, Any]:
    """`node`'s params with `jaxpr` retraced from `body` (inputs weakly typed per
    `weak`); the retraced results must have the body's types."""
    args = [
        jax.ShapeDtypeStruct(body.values[v].shape, body.values[v].dtype, weak_type=w)
        for v, w in zip(body.inputs, weak, strict=True)
    ]
    new = jax.make_jaxpr(retrace(body))(*args)
    got = [(tuple(a.shape), a.dtype) for a in new.out_avals]
    want = [(body.values[v].shape, body.values[v].dtype) for v in body.outputs]
    if got != want:
        raise AssertionError(f"remat: retraced scan body results {got} != {want}")
    return {**node.params, "jaxpr": new}


# --- what the pass does, for a plan's notes and a memory budget ------------------------


def residual_bytes(graph: Graph) -> int:
    """Bytes of the residual stacks that backward scans read from forward scans
    (each stored value once, all layers)."""
    return sum(_pair_bytes(graph, p) for p in scan_pairs(graph))


def body_flops(g: Graph) -> float:
    """FLOPs of one run of `g`, nested scans counted once per step."""
    return sum(
        body_flops(n.body) * int(n.params["length"]) if is_scan(n) else node_flops(n, g)
        for n in g.nodes
    )


def rematerialize(
    graph: Graph,
    policy: str,
    layers: int | None = None,
    unrolled: bool = True,
    wait_for_gradients: bool = False,
) -> tuple[Graph, RematReport]:
    """`remat(graph, policy)` and then, on layers unrolled in Python (`find_stacks`),
    `remat_unrolled.remat_layers` over each stack's layers (with `layers`, only the first
    stack's first `layers`: their residuals are kept longest; at the start of the backward
    pass, the peak, every layer's are held); with what changed. `unrolled` False: the
    caller knows the graph holds no such stack (its only one was rolled into loops), so
    none is looked for (0.4 s a call on a rolled 96-layer step, once per try).
    `wait_for_gradients`: as `remat_layers` (for a compiler that drops barriers)."""
    out = remat(graph, policy)
    report = remat_report(graph, out, policy)
    if policy == "none" or not unrolled:
        return out, report
    stacks, done = find_stacks(out), set()  # done: stacks by their first layer's params
    if not stacks and not report.applied:
        report = replace(report, near=why_no_stack(out) or "")
    while stack := next((s for s in stacks if s.forward[0].params not in done), None):
        done.add(stack.forward[0].params)
        first, n = len(done) == 1, len(stack.forward)
        if not first and layers is not None:
            report = replace(report, skipped=(*report.skipped, stack.describe()))
            continue
        back = {b.index: b.nodes for b in stack.backward}
        out, changed = remat_layers(
            out,
            [b.nodes for b in stack.forward],
            [back.get(b.index, ()) for b in stack.forward],
            policy,
            layers=None if layers is None else range(min(layers, n)),
            wait_for_gradients=wait_for_gradients,
        )
        if first:  # recorded though nothing changed (the user's jax.checkpoint)
            report = replace(
                report, stack=stack.describe(), layers=changed, stack_layers=n, period=stack.period
            )
        elif changed:
            other = (stack.describe(), changed, stack.period)
            report = replace(report, others=(*report.others, other))
        if changed and len(done) < len(stacks):  # node ids moved: the others found again
            stacks = find_stacks(out)
    return out, report


def remat_report(before: Graph, after: Graph, policy: str = "") -> RematReport:
    """What `remat` changed from `before` to `after` (= `remat(before, policy)`), pair
    by pair (pairs keep their node ids)."""
    after_pairs = {(p.forward, p.backward): p for p in scan_pairs(after)}
    out: list[PairRemat] = []
    for p in scan_pairs(before):
        f, b = before.nodes[p.forward], before.nodes[p.backward]
        q = after_pairs.get((p.forward, p.backward))
        out.append(
            PairRemat(
                forward=f.key,
                backward=b.key,
                layers=int(f.params["length"]),
                residuals_before=len({k for _, k in p.reads}),
                residuals_after=len({k for _, k in q.reads}) if q else 0,
                bytes_before=_pair_bytes(before, p),
                bytes_after=_pair_bytes(after, q) if q else 0,
                recompute_flops=int(b.params["length"])
                * (body_flops(after.nodes[p.backward].body) - body_flops(b.body)),
            )
        )
    return RematReport(policy, tuple(out))


def _pair_bytes(graph: Graph, p: ScanPair) -> int:
    f = graph.nodes[p.forward]
    lf = Layout.of(f)
    return sum(graph.values[f.outputs[lf.num_carry + k]].nbytes for k in {k for _, k in p.reads})


def choose_policy(graph: Graph, max_residual_bytes: float) -> str:
    """The first of `POLICIES` (least recomputation first) whose stored residuals fit
    `max_residual_bytes`; `"full"` if none does."""
    for policy in POLICIES:
        if residual_bytes(remat(graph, policy)) <= max_residual_bytes:
            return policy
    return POLICIES[-1]
