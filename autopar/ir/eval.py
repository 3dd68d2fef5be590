"""Evaluation of a captured graph: the one interpreter of `Graph`s.

`evaluate(graph, args)` computes a graph's outputs from its flat inputs node by
node, binding each node's primitive with its captured params, as
`jax.core.eval_jaxpr` does for a jaxpr: constants are read as captured, and a
`scan` (`cond`) node binds its `jaxpr` (`branches`) param, so `Node.body`
(`Node.branches`) is not walked. A caller changes how a node is evaluated with a
`bind` hook, `bind(node, invals) -> outvals` (a list, one value per output):
`bind_node` is the default; mixed precision's XLA:CPU variant upcasts the operands
of reduced-precision contractions, the jit lowering drops traced shardings, a
pipeline's head lays each result out as the plan has it.

`retrace(graph)` is the graph as a function of its flat inputs (a tuple of its
outputs), for `jax.make_jaxpr` and `jax.jit`: a pass that rewrites a scan body or a
cond branch retraces the node's `jaxpr` (`branches`) param from the new graph.
`run_nodes` is the loop itself over any nodes, reader and environment, for a caller that
evaluates a graph in pieces (gradient accumulation: before, in and after its loop).
`drawn_per_microbatch` gives a random draw (`random_bits`) run once per micro-batch
(accumulation, pipelines) its own key: the micro-batch's index folded into it.
A pass that rewrites a step and captures it again binds the step's ops through its
evaluator, so the new ops' source lines are this file's: `bind_marked` binds each in
a name scope that carries its id and `relined` gives it its user line back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import jax

from autopar.ir.graph import Graph, Node

# bind(node, invals) -> outvals: how one node is evaluated on its operand values
Bind = Callable[[Node, list[Any]], Sequence[Any]]


def bind_node(node: Node, invals: Sequence[Any], params: Mapping[str, Any] | None = None) -> list:
    """`node`'s primitive applied to `invals` with its captured params (or `params`,
    a caller's edited copy), as `jax.core.eval_jaxpr` binds an eqn; the results as a
    list (one per output, whether or not the primitive has multiple results)."""
    bound = node.primitive.get_bind_params(dict(node.params if params is None else params))
    out = node.primitive.bind(*invals, **bound)
    return list(out) if node.primitive.multiple_results else [out]


def drawn_per_microbatch(node: Node, invals: Sequence[Any], index: Any) -> list:
    """`invals` of `node`, a random draw's key (`random_bits`' operand: a typed key
    array of any shape) with the micro-batch `index` folded into every key; other nodes'
    as they are. Drawn from the step's key alone, every micro-batch of a loop would draw
    the same dropout mask."""
    if index is None or node.op != "random_bits":
        return list(invals)
    key, *rest = invals
    fold = lambda k: jax.random.fold_in(k, index)  # noqa: E731
    folded = fold(key) if key.ndim == 0 else jax.vmap(fold)(key.reshape(-1)).reshape(key.shape)
    return [folded, *rest]


MARK = "autopar_op"  # name scope of an op bound again, with its id (`bind_marked`)


def marked(node: Node):
    """A name scope that says which op of the captured graph `node` is (for `relined`):
    what is bound in it, bound again for `node`."""
    return jax.named_scope(f"{MARK}{node.id}")


def bind_marked(node: Node, invals: Sequence[Any], index: Any = None) -> list:
    """`bind_node` in `marked(node)`; a random draw's key folded with micro-batch
    `index` first."""
    with marked(node):
        return bind_node(node, drawn_per_microbatch(node, invals, index))


def relined(new: Graph, graph: Graph) -> Graph:
    """`new` (a rewrite of `graph`, captured again: its ops' lines are this file's)
    with each op `bind_marked` bound for an op of `graph` given that op's user line;
    ops inside it (a loop's body) keep their own. Name stacks stay the rewrite's, the
    mark taken out: the search reads phases (forward, backward) and layers from them,
    and a rewrite's plans were measured under its own (benchmarks/discussion.md,
    session 52)."""
    nodes = []
    for n in new.nodes:
        parts = n.name_stack.split("/") if n.name_stack else []
        k = next(
            (i for i, p in enumerate(parts) if p.startswith(MARK) and p[len(MARK) :].isdigit()),
            None,
        )
        if k is not None:
            o = graph.nodes[int(parts[k][len(MARK) :])]
            # the op itself (under a transform's empty scope, `vmap()`), not one in its body
            own = all(p.endswith("()") for p in parts[k + 1 :])
            where = {"source": o.source, "library_source": o.library_source} if own else {}
            n = replace(n, name_stack="/".join(parts[:k] + parts[k + 1 :]), **where)
        if n.body is not None:
            n = replace(n, body=relined(n.body, graph))
        nodes.append(n)
    return replace(new, nodes=tuple(nodes))


def run_nodes(
    nodes: Iterable[Node],
    read: Callable[[int], Any],
    env: dict[int, Any],
    bind: Bind = bind_node,
) -> dict[int, Any]:
    """Evaluate `nodes` in order: each reads its operands with `read(value id)` and
    stores its results in `env` (value id -> value), which `read` may consult; `env`."""
    for node in nodes:
        outs = bind(node, [read(v) for v in node.inputs])
        env.update(zip(node.outputs, outs, strict=True))
    return env


def evaluate(graph: Graph, args: Sequence[Any], bind: Bind = bind_node) -> list:
    """`graph`'s outputs on its flat inputs `args`, every node evaluated by `bind`."""
    env: dict[int, Any] = dict(zip(graph.inputs, args, strict=True))
    read = lambda v: graph.consts[v] if v in graph.consts else env[v]
    run_nodes(graph.nodes, read, env, bind)
    return [read(v) for v in graph.outputs]


def retrace(graph: Graph, bind: Bind = bind_node) -> Callable[..., tuple]:
    """A function of `graph`'s flat inputs that evaluates it (`evaluate`), its outputs
    as a tuple: trace it (`jax.make_jaxpr`, `jax.jit`) to get the graph back as JAX."""

    def run(*flat_args):
        return tuple(evaluate(graph, flat_args, bind))

    return run
