"""jit lowering: re-run the graph op by op, pinning every value to the plan's spec
with `with_sharding_constraint`; XLA's partitioner inserts the collectives."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import NamedSharding

from autopar.ir import Graph
from autopar.plan import Plan
from autopar.search.evaluate import settle_partials
from autopar.sharding import Spec


def interpret(graph: Graph, plan: Plan, mesh) -> Callable:
    """A function of the flat args that computes `graph` under `plan`'s shardings."""
    in_specs = {v: r.spec for v, r in zip(graph.inputs, plan.inputs)}
    settled = settle_partials(
        graph,
        [o.in_specs for o in plan.ops],
        [o.out_specs for o in plan.ops],
        [r.spec for r in plan.outputs],
    )

    def constrain(x, spec: Spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec.to_pspec()))

    def run(*flat_args):
        env: dict[int, object] = dict(zip(graph.inputs, flat_args))
        produced: dict[int, Spec] = dict(in_specs)

        def read(v: int, want: Spec):
            if v in graph.consts:
                return graph.consts[v]
            have = produced[v]
            if have == want or not want.dims and not have.partial:
                return env[v]
            return constrain(env[v], want)

        for node, rec in zip(graph.nodes, plan.ops):
            invals = [read(v, s) for v, s in zip(node.inputs, rec.in_specs)]
            outs = bind(node, invals)
            if not node.primitive.multiple_results:
                outs = [outs]
            for v, val, spec in zip(node.outputs, outs, rec.out_specs):
                spec = settled.get(v, spec)
                env[v] = val if spec.partial or not spec.dims else constrain(val, spec)
                produced[v] = spec
        return tuple(read(v, r.spec) for v, r in zip(graph.outputs, plan.outputs))

    return run


def bind(node, invals):
    """Apply a captured node's primitive, as `jax.core.eval_jaxpr` does."""
    params = node.primitive.get_bind_params(node.params)
    return node.primitive.bind(*invals, **params)


def jit_from_plan(graph: Graph, plan: Plan, mesh, donate: Sequence[int] = ()):
    """`jax.jit` of the interpreted graph with the plan's in/out shardings."""
    shard = lambda recs: tuple(NamedSharding(mesh, r.spec.to_pspec()) for r in recs)
    return jax.jit(
        interpret(graph, plan, mesh),
        in_shardings=shard(plan.inputs),
        out_shardings=shard(plan.outputs),
        donate_argnums=tuple(donate),
    )
