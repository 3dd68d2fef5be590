"""Gradient accumulation: the batch-dependent part of a step as a loop over micro-batches.

`accumulate(graph, micro, batch_inputs, M)` rewrites a captured step so that
everything that can run micro-batch by micro-batch (`autopar.passes.microbatch.separate`:
the forward and backward passes up to the weight gradients) runs in a `scan` over
`M` micro-batches, and the rest (the optimizer update, anything that needs the
whole batch) runs once after it on the accumulated values:

* a value Partial over the micro-batches (a gradient: a sum over the batch) is
  accumulated in the loop's carry;
* a batched value that the rest needs (say per-example losses returned by the step)
  comes out of the loop as `ys` and is put back together;
* batch-free values (weights, their casts) are computed once before the loop.

Only one micro-batch's activations are alive at a time, which is the point. The loop
body is the function traced at the micro-batch size (`micro`), with the full trace's
constants wherever their shapes agree (a sharded program keeps the global program's
constants: a mean over the batch divides by the whole batch in every micro-batch).
Micro-batch `m` is the strided slice `m::M` of the batch dim, so a batch dim sharded
over `data` stays sharded the same way.

The rewritten function is captured again, so the loop is an ordinary `scan` node
(named ``grad_accumulation``) that every later pass understands: the search prices it
at `M` steps of its body, searched at the micro-batch size. Its carry may stay a
Partial sum across steps (see `search.problem`), so the data-parallel gradient
all-reduce happens once per step, after the loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from autopar.cost.model import node_flops
from autopar.errors import MicrobatchError
from autopar.ir.capture import abstract_value, abstractify_tree, arg_names, capture
from autopar.ir.eval import bind_marked, relined, run_nodes
from autopar.ir.graph import Graph, Node, upstream
from autopar.passes.microbatch import cut, mixing, separate, split_spec, uncut
from autopar.sharding import Spec

SCOPE = "grad_accumulation"  # name scope of the loop, how the search recognizes it


def is_accumulation(node: Node) -> bool:
    return node.body is not None and node.name_stack.split("/")[-1] == SCOPE


def batch_problem(batch: Any, microbatches: int, name: str = "batch") -> str | None:
    """Why the batch pytree `batch` (the argument `name`) cannot be cut into
    `microbatches` along its leaves' leading dim, naming the leaves at fault (a scalar, a
    leaf whose leading size differs from the rest's); None when it can."""
    M = microbatches
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    lead = [tuple(getattr(x, "shape", ()))[:1] for _, x in leaves]
    common = Counter(d[0] for d in lead if d).most_common(1)
    b = common[0][0] if common else None

    def described(path, x) -> str:
        if not hasattr(x, "dtype"):
            return f"{name}{jax.tree_util.keystr(path)} (a Python {type(x).__name__})"
        return f"{name}{jax.tree_util.keystr(path)} {x.dtype}{list(getattr(x, 'shape', ()))}"

    scalars = [described(p, x) for (p, x), d in zip(leaves, lead) if not d]
    other = [described(p, x) for (p, x), d in zip(leaves, lead) if d and d[0] != b]
    head = (
        f"grad_accumulation={M} cuts the batch ({name}, the last argument but PRNG keys) "
        "along its leaves' leading dim"
    )
    if b is None:
        what = ", ".join(described(p, x) for p, x in leaves[:3]) or "no arrays"
        return (
            f"{head}, but it has no leaf with a leading dim ({what}): put the batch last, "
            f"e.g. f(params, opt_state, {name}, batch)"
        )
    if scalars or other:
        parts = []
        if scalars:
            parts.append(f"{', '.join(scalars)} {'has' if len(scalars) == 1 else 'have'} none")
        if other:
            parts.append(
                f"{', '.join(other)} {'does' if len(other) == 1 else 'do'} not lead with {b}"
            )
        return (
            f"{head}, {b} for the others, but " + " and ".join(parts) + "; pass such "
            "values in another argument or close over them"
        )
    if b % M:
        return f"{head}, {b}, which is not divisible by {M}"
    return None


def is_key(x: Any) -> bool:
    """A PRNG key: a typed key array, or a raw `uint32[2]` one (`jax.random.PRNGKey`)."""
    dtype, shape = getattr(x, "dtype", None), tuple(getattr(x, "shape", (None,)))
    if dtype is None:
        return False
    return jnp.issubdtype(dtype, jax.dtypes.prng_key) or (dtype == jnp.uint32 and shape == (2,))


def batch_argument(args: Sequence[Any], static: Collection[int], n_keywords: int) -> int | None:
    """The position of the batch: the last non-static positional argument that is not
    PRNG keys alone (`transformers`' Flax scripts call `train_step(state, batch,
    dropout_rng)`); None where there is no such argument."""
    dyn = [i for i in range(len(args) - n_keywords) if i not in static]
    for i in reversed(dyn):
        leaves = jax.tree_util.tree_leaves(args[i])
        if not leaves or not all(is_key(x) for x in leaves):
            return i
    return dyn[-1] if dyn else None


def batch_arguments(args: Sequence[Any], static: Collection[int], n_keywords: int) -> list[int]:
    """The positions of the batch: `batch_argument`, and the arguments right before it
    whose every leaf is an array as long as its leaves along the leading dim
    (`step(model, optimizer, x, y)`); empty where there is no batch argument."""
    at = batch_argument(args, static, n_keywords)
    if at is None:
        return []
    lead = {getattr(x, "shape", ())[:1] for x in jax.tree_util.tree_leaves(args[at])}
    out = [at]
    if len(lead) != 1 or () in lead:
        return out
    for i in reversed([i for i in range(at) if i not in static]):
        leaves = jax.tree_util.tree_leaves(args[i])
        if not leaves or not all(getattr(x, "shape", ())[:1] in lead for x in leaves):
            break
        out.insert(0, i)
    return out


def micro_batch_args(
    fn: Callable, args: Sequence[Any], static: Collection[int], n_keywords: int, M: int, name: str
) -> tuple[list, range]:
    """The call's arguments with its batch (`batch_arguments`) as one micro-batch's
    abstract arrays, their leaves cut to `1/M` along their leading dim, and the
    positions of the batch's leaves among the flat inputs. Raises MicrobatchError,
    naming the leaves at fault, where the batch does not cut so."""
    ats = batch_arguments(args, static, n_keywords)
    if not ats:
        raise MicrobatchError(f"{name}: grad_accumulation needs a batch argument")
    dyn = [i for i in range(len(args) - n_keywords) if i not in static]
    first = sum(len(jax.tree_util.tree_leaves(args[i])) for i in dyn if i < ats[0])
    names = arg_names(fn, ats[-1] + 1)
    for at in ats:
        why = batch_problem(args[at], M, names[at])
        if why:
            raise MicrobatchError(f"{name}: {why}")
    margs, count = list(args), 0
    for at in ats:
        b = jax.tree_util.tree_leaves(args[at])[0].shape[0]
        cut_one = (
            lambda x, b=b: jax.ShapeDtypeStruct(  # noqa: E731
                (b // M, *x.shape[1:]), x.dtype, weak_type=x.weak_type
            )
        )
        margs[at] = jax.tree_util.tree_map(cut_one, abstractify_tree(args[at]))
        count += len(jax.tree_util.tree_leaves(args[at]))
    return margs, range(first, first + count)


def batch_hint(
    fn: Callable, args: Sequence[Any], static: Collection[int], n_keywords: int, M: int
) -> str:
    """What to do when the step fails traced on `micro_batch_args`: only the last
    argument is the batch, so the arguments before it that look like part of the batch
    (arrays whose leading dim is the batch's) are named, with how to pass them."""
    dyn = [i for i in range(len(args) - n_keywords) if i not in static]
    ats = batch_arguments(args, static, n_keywords)
    at = ats[-1]
    names = arg_names(fn, dyn[-1] + 1)
    b = jax.tree_util.tree_leaves(args[at])[0].shape[0]
    shapes = {
        names[i]: leaves[0].shape
        for i in dyn
        if i not in ats
        for leaves in [jax.tree_util.tree_leaves(args[i])]
        if len(leaves) == 1 and getattr(leaves[0], "ndim", 0) >= 1 and leaves[0].shape[0] == b
    }
    which = "the last positional argument" if at == dyn[-1] else "the last but PRNG keys"
    cut = ", ".join(names[i] for i in ats)
    head = (
        f"grad_accumulation={M} cuts the batch, {which} ({cut}"
        f"{', and the arrays right before it as long' if len(ats) > 1 else ''}), into {M} "
        f"micro-batches of {b // M}"
    )
    if not shapes:
        return head + "; the step must run on a micro-batch of that size"
    listed = ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
    return (
        f"{head}, but {listed} before it also has the batch's leading dim {b} and was not "
        f"cut: pass the whole batch as the last argument, e.g. f(..., ({', '.join(shapes)}, "
        f"{cut}))"
    )


def accumulate(
    graph: Graph, micro: Graph, batch_inputs: Sequence[int], microbatches: int, mesh=None
) -> tuple[Graph, tuple[str, ...]]:
    """`graph` with its per-micro-batch part in a loop over `microbatches` micro-batches,
    and notes for the plan (`_notes`). `micro` is the same function traced with the
    inputs at positions `batch_inputs` cut to `1/microbatches` along their leading
    (batch) dim."""
    if [n.op for n in graph.nodes] != [n.op for n in micro.nodes] or len(graph.values) != len(
        micro.values
    ):
        one = micro.values[micro.inputs[batch_inputs[0]]].shape[:1] == (1,)
        raise MicrobatchError(
            f"{graph.name} is a different computation at the micro-batch size "
            f"({len(graph.nodes)} vs {len(micro.nodes)} ops); gradient accumulation needs a "
            "step whose ops do not depend on the batch size (try fewer micro-batches"
            + (
                f": with {microbatches} each has one example, which JAX traces with fewer "
                "ops, size-1 dims squeezed)"
                if one
                else ")"
            )
        )
    M = microbatches
    in_specs = []
    for i, v in enumerate(graph.inputs):
        t = graph.values[v]
        if i in batch_inputs:
            in_specs.append(split_spec(t.rank, 0))
        else:
            in_specs.append(Spec.replicated(t.rank))
    # statistics of the batch alone (a label count, `mask.sum()`) that stop the loop: on
    # the whole batch before it, as `jax.jit` computes them
    early: dict[int, Spec] = {}
    batch_only = _batch_only(graph, batch_inputs)
    while True:
        have, first_bad = separate(graph, in_specs, M, micro, fixed=early)
        new = _statistics(graph, micro, first_bad, have, batch_only) - early.keys()
        if not new:
            break
        early.update((v, Spec.replicated(graph.values[v].rank)) for v in new)

    # where every value is computed: before the loop, in it, or after it
    where = {v: ("loop" if i in batch_inputs else "pre") for i, v in enumerate(graph.inputs)}
    where.update({v: "pre" for v in graph.consts})
    for node in graph.nodes:
        ins = {where[v] for v in node.inputs}
        if node.outputs and all(v in early for v in node.outputs):
            place = "pre"
        elif "post" in ins:
            place = "post"
        elif "loop" in ins or any(graph.values[v] != micro.values[v] for v in node.outputs):
            # (a batch-shaped value made from nothing, e.g. zeros, is made per micro-batch)
            place = "loop" if all(v in have for v in node.outputs) else "post"
        else:
            place = "pre"
        where.update({v: place for v in node.outputs})

    needed_after = [
        v
        for n in graph.nodes
        if where[n.outputs[0]] == "post"
        for v in n.inputs
        if where[v] == "loop"
    ] + [v for v in graph.outputs if where[v] == "loop"]
    needed_after = list(dict.fromkeys(needed_after))
    sums = [v for v in needed_after if have[v].partial]
    pieces = [v for v in needed_after if not have[v].partial and have[v].used_axes]
    # the same in every micro-batch (a scanned layer's rng counts): the last one's
    sames = [v for v in needed_after if v in have and v not in sums and v not in pieces]
    lost = [v for v in needed_after if v not in sums and v not in pieces and v not in sames]
    if lost:
        raise MicrobatchError(
            f"{graph.name}: gradient accumulation cannot hand {graph.values[lost[0]]} from the "
            "micro-batch loop to the rest of the step"
        )
    if not any(where[n.outputs[0]] == "loop" for n in graph.nodes if n.outputs):
        raise MicrobatchError(f"{graph.name}: nothing in the step depends on the batch arguments")

    cone = upstream(graph, early)  # what the statistics are made of: also before the loop
    handed = (sums, pieces, sames)
    fn = _rewritten(graph, micro, batch_inputs, M, where, handed, have, cone)
    args = [abstract_value(graph.values[v]) for v in graph.inputs]
    new = relined(capture(fn, args, (), mesh), graph)
    new = replace(
        new,
        input_paths=graph.input_paths,
        output_paths=graph.output_paths,
        in_tree=graph.in_tree,
        out_tree=graph.out_tree,
        name=graph.name,
    )
    why = f" ({mixing(graph, have, first_bad)})" if first_bad is not None else ""
    notes = _notes(graph, new, first_bad, M, why)
    if early:
        made = sorted({graph.producer[v] for v in early})
        what = ", ".join(f"{graph.nodes[i].op} at {graph.nodes[i].key}" for i in made[:3])
        notes = (
            f"gradient accumulation: {len(made)} statistic{'s' if len(made) > 1 else ''} "
            f"of the batch alone ({what}{', ...' if len(made) > 3 else ''}: a label or token "
            "count) computed on the whole batch before the micro-batch loop, as jax.jit "
            "computes them",
            *notes,
        )
    return new, notes


def _batch_only(graph: Graph, batch_inputs: Sequence[int]) -> set[int]:
    """The values made from the batch's inputs and constants alone (labels, masks and
    what is counted of them), no parameter or state."""
    out = {graph.inputs[i] for i in batch_inputs}
    for node in graph.nodes:
        if all(x in out or x in graph.consts for x in node.inputs):  # (an iota: nothing)
            out.update(node.outputs)
    return out


def _statistics(
    graph: Graph, micro: Graph, bad: Node | None, have: dict, batch_only: set[int]
) -> set[int]:
    """What to compute on the whole batch before the loop so that `bad` (the first op
    that cannot run per micro-batch) can: its batch-only operands that are sums over
    the batch (`mask.sum()` dividing a sum of losses), or, where it reads the batch
    alone, its results; values without the batch dim only (the same in both traces)."""
    if bad is None:
        return set()
    if all(x in batch_only or x in graph.consts for x in bad.inputs):
        cands = set(bad.outputs)
    else:
        cands = {x for x in bad.inputs if x in batch_only and x in have and have[x].partial}
    return {v for v in cands if graph.values[v] == micro.values[v]}


def _notes(
    graph: Graph, new: Graph, first_bad: Node | None, M: int, why: str = ""
) -> tuple[str, ...]:
    """What the plan should say of the loop: how little of the step's work it holds
    when something before the optimizer needs the whole batch (batch statistics), and
    that its random draws are the micro-batches' own."""
    (loop,) = [n for n in new.nodes if is_accumulation(n)]
    inside = M * sum(node_flops(n, loop.body) for n in loop.body.nodes)
    total = sum(node_flops(n, graph) for n in graph.nodes)
    notes = []
    if total and inside < 0.5 * total:
        cause = f" from {first_bad.op} at {first_bad.key}{why}" if first_bad is not None else ""
        kind = (
            ""
            if first_bad is not None and first_bad.op == "iota"
            else " (batch statistics such as BatchNorm's, or a loss over the whole batch)"
        )
        notes.append(
            f"gradient accumulation: only {inside / total:.0%} of the step's FLOPs run "
            f"micro-batch by micro-batch; the rest needs the whole batch{cause}{kind}, so "
            "the micro-batches save little memory"
        )
    draws = list(dict.fromkeys(n.key for n in loop.body.nodes if n.op == "random_bits"))
    if draws:
        at = ", ".join(draws[:3]) + (f" and {len(draws) - 3} more" if len(draws) > 3 else "")
        notes.append(
            f"gradient accumulation: random numbers ({at}: dropout masks, a diffusion "
            "step's noise) are drawn per micro-batch, its index folded into the key: a "
            "different, equally random draw than jax.jit's on the whole batch; to compare "
            "numbers, set dropout rates to 0 and pass other draws in with the batch"
        )
    return tuple(notes)


def _rewritten(graph, micro, batch_inputs, M, where, handed, have, early) -> Callable:
    """The step with its `where == "loop"` ops in a scan over micro-batches; `handed`:
    what the loop hands on (sums accumulated in its carry, pieces of batched values as
    its `ys`, values the same in every micro-batch carried out from the last); `early`:
    ids of nodes also run before the loop, on the whole batch."""
    sums, pieces, sames = handed
    pre, loop_nodes, post = (
        [
            n
            for n in graph.nodes
            if n.outputs and (where[n.outputs[0]] == place or (place == "pre" and n.id in early))
        ]
        for place in ("pre", "loop", "post")
    )
    # in the loop, the micro-batch trace's ops (its shape params) make the full trace's values
    micro_loop = [replace(micro.nodes[n.id], outputs=n.outputs) for n in loop_nodes]
    consts = {
        v: graph.consts[v] if graph.values[v] == micro.values[v] else c
        for v, c in micro.consts.items()
    }
    batched = [graph.inputs[i] for i in sorted(batch_inputs)]
    piece_dim = {v: next(d for d, a in enumerate(have[v].dims) if a) for v in pieces}
    # a piece's split dim is the batch, or the batch merged with the dims after it
    # (tokens): `inner` rows per example, kept together as the inputs' cut keeps them
    examples = graph.values[batched[0]].shape[0]
    inner = {
        v: n // examples if n % examples == 0 else 1
        for v, d in piece_dim.items()
        for n in [graph.values[v].shape[d]]
    }

    def fn(*flat):
        env: dict[int, object] = dict(zip(graph.inputs, flat))
        read = lambda v: env[v] if v in env else jnp.asarray(graph.consts[v])
        run_nodes(pre, read, env, bind_marked)

        def step(carry, xs):
            *xs, index = xs
            local = dict(zip(batched, xs))
            lread = lambda v: (
                local[v] if v in local else env[v] if v in env else jnp.asarray(consts[v])
            )
            # a draw of random bits (a dropout mask) takes the micro-batch's index folded
            # into its key: drawn from the step's key alone, every micro-batch would get
            # the same mask
            run_nodes(micro_loop, lread, local, lambda n, ins: bind_marked(n, ins, index))
            summed = [c + local[v] for c, v in zip(carry, sums)]
            return [*summed, *(local[v] for v in sames)], [local[v] for v in pieces]

        init = [jnp.zeros(graph.values[v].shape, graph.values[v].dtype) for v in (*sums, *sames)]
        with jax.named_scope(SCOPE):
            xs = [*(cut(env[v], 0, M) for v in batched), jnp.arange(M, dtype=jnp.uint32)]
            total, ys = jax.lax.scan(step, init, xs)
        env.update(zip((*sums, *sames), total))
        env.update((v, uncut(y, piece_dim[v], inner=inner[v])) for v, y in zip(pieces, ys))
        run_nodes(post, read, env, bind_marked)
        return [read(v) for v in graph.outputs]

    return fn
