"""Which values of a graph can be computed micro-batch by micro-batch.

Cutting the batch into micro-batches is sharding it over a virtual mesh axis "mb":
a value split along its batch dim holds one micro-batch per "device", a Partial sum
over "mb" is a sum over micro-batches (a weight gradient), a replicated value is the
same for every micro-batch. An op can run per micro-batch exactly when the strategy
registry has a strategy for it that needs no communication on that axis (a whole
value may be sliced for free); `separate` propagates such strategies through the
graph. Only sums count as Partial here: a reduction whose pending value is a max
(`reduce_max` over the batch) mixes micro-batches, except the float16 range
scales of `autopar.passes.precision`: computed per micro-batch, a scale can only differ
in which tiny elements it lets reach float16's subnormals, so they run per
micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from autopar.ir.graph import Graph, Node
from autopar.ir.ops import CONTRACTIONS
from autopar.passes.positions import Positions
from autopar.passes.precision import is_range_scale
from autopar.sharding import MeshInfo, Spec

AXIS = "mb"
# ops whose Partial output over a reduced dim is a pending *sum*
_SUMS = CONTRACTIONS | {"reduce_sum"}


def virtual_mesh(microbatches: int) -> MeshInfo:
    return MeshInfo.build((AXIS,), (microbatches,), None, 1)


def split_spec(rank: int, dim: int) -> Spec:
    return Spec(tuple((AXIS,) if d == dim else () for d in range(rank)))


def sum_spec(rank: int) -> Spec:
    return Spec(((),) * rank, (AXIS,))


def fits(want: Spec, got: Spec) -> bool:
    """`got` can feed a strategy that wants `want` without communicating."""
    return want == got or (not got.partial and not got.used_axes and not want.partial)


def matches_trace(spec: Spec, full: tuple[int, ...], micro: tuple[int, ...], m: int) -> bool:
    """The value traced at the micro-batch size (`micro`) is one micro-batch of `full`
    laid out as `spec`: cut by `m` along the split dim, whole otherwise."""
    dims = [d for d, axes in enumerate(spec.dims) if axes]
    if not dims:
        return full == micro
    (d,) = dims
    return full[:d] + full[d + 1 :] == micro[:d] + micro[d + 1 :] and full[d] == micro[d] * m


def separate(
    graph: Graph,
    in_specs: Sequence[Spec],
    microbatches: int,
    micro: Graph | None = None,
    positions: bool = True,
    fixed: dict[int, Spec] | None = None,
) -> tuple[dict[int, Spec], Node | None]:
    """Per value that can be computed per micro-batch, its spec over "mb", given the
    inputs' specs; and the first node that cannot (None when every node can). Values
    downstream of such a node are left out. With `micro` (the same graph traced at the
    micro-batch size), a strategy must also lay its outputs out as that trace cut them.
    `positions`: `jnp.arange` over the batch may index the batch per micro-batch
    (`autopar.passes.positions`); where a position would leave the micro-batch program,
    the graph is separated again without. `fixed`: values given their spec (computed
    elsewhere: `accumulate`'s statistics of the batch alone, on the whole batch)."""
    from autopar.strategies import enumerate_factor_rule, strategies_for
    from autopar.strategies.elementwise import ELEMENTWISE, elementwise_rule
    from autopar.strategies.linear import PARTIAL, partial_variants

    mesh = virtual_mesh(microbatches)
    have = dict(zip(graph.inputs, in_specs))
    first_bad = None
    pos = Positions(graph, AXIS) if positions else None
    for node in graph.nodes:
        if fixed and node.outputs and all(v in fixed for v in node.outputs):
            have.update((v, fixed[v]) for v in node.outputs)
            continue
        if any(v not in have and v not in graph.consts for v in node.inputs):
            continue
        got = [have.get(v, Spec.replicated(graph.values[v].rank)) for v in node.inputs]
        if pos is not None and ((start := pos.iota(node, micro)) or pos.reads(node)):
            outs = [start] if start else pos.step(node, got)
            if outs is None or not all(
                micro is None
                or matches_trace(o, graph.values[v].shape, micro.values[v].shape, microbatches)
                for o, v in zip(outs, node.outputs)
            ):
                first_bad = first_bad or node
            else:
                have.update(zip(node.outputs, outs))
            continue
        if is_range_scale(node) and node.op == "reduce_max":
            # a float16 operand's max|x|: per micro-batch it only picks the scale
            have.update((v, Spec.replicated(graph.values[v].rank)) for v in node.outputs)
            continue
        if node.body is not None and "num_carry" in node.params:  # a scan: its body's
            twin = (
                micro.nodes[node.id] if micro is not None and node.id < len(micro.nodes) else None
            )
            mbody = twin.body if twin is not None and twin.op == node.op else None
            outs = _scan_specs(node, got, microbatches, mbody)
            if outs is None:
                first_bad = first_bad or node
            else:
                have.update(zip(node.outputs, outs))
            continue
        if node.op in ELEMENTWISE:
            rule = elementwise_rule(node, graph, split_broadcast=True)
            candidates = enumerate_factor_rule(rule, mesh)
            candidates += partial_variants(node, graph, mesh, candidates)
        else:
            candidates = strategies_for(node, graph, mesh).strategies
        options = [
            s
            for s in candidates
            if all(fits(w, g) for w, g in zip(s.in_specs, got))
            # positions (`jnp.arange` along the batch): a micro-batch's own are no rows
            # of the whole batch's, so they cannot stand for them outside the loop
            and not (node.op == "iota" and any(o.used_axes for o in s.out_specs))
            and (
                not any(o.partial for o in s.out_specs)
                or node.op in _SUMS
                or PARTIAL in s.assignment
            )
            and (
                micro is None
                or all(
                    matches_trace(o, graph.values[v].shape, micro.values[v].shape, microbatches)
                    for o, v in zip(s.out_specs, node.outputs)
                )
            )
        ]
        if not options:
            first_bad = first_bad or node
            continue
        # the fewest free slices, then the most work split
        best = min(
            options, key=lambda s: (sum(w != g for w, g in zip(s.in_specs, got)), -s.parallel)
        )
        have.update(zip(node.outputs, best.out_specs))
    if pos is not None and pos.escapes(have):
        return separate(graph, in_specs, microbatches, micro, positions=False, fixed=fixed)
    return have, first_bad


def mixing(graph: Graph, have: dict[int, Spec], node: Node) -> str:
    """Why `node` (the first that `separate` could not run per micro-batch) needs the
    whole batch, in words: each operand that is a sum over the batch's examples named
    by the reduction that made it (following the ops that carry the pending sum back
    to the one that started it: `mask.sum()`, a mean over tokens), the others by how
    they stand."""
    if node.op == "iota":
        return (
            f"{graph.values[node.outputs[0]]}, positions along the batch (`jnp.arange` over "
            "it, as in `logp[jnp.arange(B), labels]`): a micro-batch's are not the whole "
            "batch's; `jnp.take_along_axis(logp, labels[:, None], 1)` needs none"
        )
    parts = []
    for v in node.inputs:
        spec, t = have.get(v), graph.values[v]
        if spec is None:
            parts.append(f"{t} (itself made from the whole batch)")
        elif spec.partial:
            at = graph.producer.get(v)
            while at is not None:
                ins = graph.nodes[at].inputs
                up = next((x for x in ins if x in have and have[x].partial), None)
                if up is None or graph.producer.get(up) is None:
                    break
                at = graph.producer[up]
            made = f" from {graph.nodes[at].op} at {graph.nodes[at].key}" if at is not None else ""
            parts.append(f"{t}, a sum over the examples{made}")
        elif spec.used_axes:
            parts.append(f"{t}, per example")
        else:
            parts.append(f"{t}, the same for every example")
    return "; ".join(parts)


def batch_operands(graph: Graph, node: Node, out: int) -> tuple[int, ...]:
    """The positions of `node`'s operands whose leading dim is the leading dim of its
    output `out`, by the strategy registry (a strategy that splits that output's dim 0
    with no pending sum splits theirs): the batch of `x @ W` comes from `x`, not from a
    `W` whose contracted dim happens to be as long. A loop nested in the graph: every
    operand as long as the output along dim 0."""
    from autopar.strategies import enumerate_factor_rule, strategies_for
    from autopar.strategies.elementwise import ELEMENTWISE, elementwise_rule

    lead = graph.values[node.outputs[out]].shape[:1]
    if node.body is not None:
        return tuple(k for k, x in enumerate(node.inputs) if graph.values[x].shape[:1] == lead)
    mesh = virtual_mesh(2)
    if node.op in ELEMENTWISE:
        candidates = enumerate_factor_rule(
            elementwise_rule(node, graph, split_broadcast=True), mesh
        )
    else:
        candidates = strategies_for(node, graph, mesh).strategies
    want = split_spec(graph.values[node.outputs[out]].rank, 0)
    return tuple(
        sorted(
            {
                k
                for s in candidates
                if s.out_specs[out] == want and not any(o.partial for o in s.out_specs)
                for k, spec in enumerate(s.in_specs)
                if spec.dims[:1] == (want.dims[0],)
            }
        )
    )


def _scan_specs(
    node: Node, got: Sequence[Spec], microbatches: int, micro_body: Graph | None
) -> list[Spec] | None:
    """The specs over "mb" of a scan's outputs, where its body runs per micro-batch on
    its inputs' (`got`): a loop over layers whose carry is the batch's activations (or
    their cotangents, or a sum of weight gradients) and whose `xs` are per-layer weights
    or per-layer values split along a batch dim after the layer dim. The carry must come
    out of the body laid out as it went in; a carry whole on entry that the body makes
    split or Partial (a sum of the layers' gradients, started at zero) is taken as that
    and the body run again. None where the body mixes micro-batches."""
    p = node.params
    n_c, n_k = p["num_consts"], p["num_carry"]
    body = node.body
    ins = list(got)
    for i in range(n_c + n_k, len(ins)):  # xs: the layer dim leads, whole
        sp = ins[i]
        if sp.dims and sp.dims[0]:
            return None
        ins[i] = Spec(sp.dims[1:], sp.partial)
    for _ in range(3):
        have, bad = separate(body, ins, microbatches, micro_body)
        if bad is not None:
            return None
        outs = [have.get(v, Spec.replicated(body.values[v].rank)) for v in body.outputs]
        changed = False
        for j in range(n_k):
            want, made = ins[n_c + j], outs[j]
            if made == want:
                continue
            if want.used_axes or want.partial:  # a layout the loop would not keep
                return None
            ins[n_c + j], changed = made, True
        if not changed:
            return [*outs[:n_k], *(Spec(((), *sp.dims), sp.partial) for sp in outs[n_k:])]
    return None


def cut(x, dim: int, m: int, lead: int = 0, inner: int = 1):
    """[.., B, ..] -> micro-batches stacked at position `lead`: [.., M, .., B/M, ..].
    Micro-batch `i` holds the strided rows `i::M` of `dim`, in units of `inner` rows:
    where `dim` is the batch merged with the dims after it (tokens of `[b, s]` as
    `[b * s]`, `inner` = s), each example's `inner` rows stay together."""
    shape = x.shape
    n = shape[dim]
    x = x.reshape(*shape[:dim], n // (m * inner), m, inner, *shape[dim + 1 :])
    x = jnp.moveaxis(x, dim + 1, 0).reshape(m, *shape[:dim], n // m, *shape[dim + 1 :])
    return jnp.moveaxis(x, 0, lead)


def uncut(x, dim: int, lead: int = 0, inner: int = 1):
    """Inverse of `cut`: `dim` indexes the array once the micro-batch dim is removed."""
    x = jnp.moveaxis(x, lead, 0)
    m, shape = x.shape[0], x.shape[1:]
    n = shape[dim]
    x = x.reshape(m, *shape[:dim], n // inner, inner, *shape[dim + 1 :])
    return jnp.moveaxis(x, 0, dim + 1).reshape(*shape[:dim], n * m, *shape[dim + 1 :])
