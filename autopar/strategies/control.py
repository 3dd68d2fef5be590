"""User sharding constraints, control flow and random-number ops."""

from __future__ import annotations

from autopar.ir.graph import Graph, Node
from autopar.sharding import Spec
from autopar.strategies import Factor, FactorRule, Fixed, register, replicated_rule
from autopar.strategies.elementwise import elementwise_rule


@register("sharding_constraint")
def sharding_constraint_rule(node: Node, graph: Graph) -> Fixed:
    """A user's `with_sharding_constraint` fixes the value's spec (semi-auto parallel)."""
    t = graph.values[node.inputs[0]]
    pspec = getattr(node.params["sharding"], "spec", None)
    if pspec is None:
        return replicated_rule(node, graph, "user constraint (unnamed sharding)")
    spec = Spec.from_pspec(pspec, t.rank)
    return Fixed((spec,), (spec,), "user constraint")


@register("reshard")
def reshard_rule(node: Node, graph: Graph) -> FactorRule | Fixed:
    """`jax.sharding.reshard`, which jnp functions insert under a mesh (`jnp.where`):
    on a mesh whose axes are all Auto it lowers to nothing (JAX emits no sharding op),
    so it is an identity op like `copy`; on Explicit axes its spec is fixed, like a
    user's constraint."""
    sharding = node.params.get("dst_sharding")
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "are_all_axes_auto", False) or mesh.empty:
        return elementwise_rule(node, graph)
    spec = Spec.from_pspec(sharding.spec, graph.values[node.inputs[0]].rank)
    return Fixed((spec,), (spec,), "reshard to an Explicit-axis sharding")


@register("while", "cond")
def control_flow_rule(node: Node, graph: Graph) -> Fixed:
    """`while` runs replicated; so does a `cond` where its branches are not searched
    (the micro-batch check, `autopar.passes.microbatch`, asks every op's rule)."""
    return replicated_rule(
        node,
        graph,
        f"replicated {node.op}",
        f"control flow '{node.op}' at {node.key} runs replicated: autopar does not search inside while loops yet (scan bodies and cond branches are searched)",
    )


@register(
    "random_seed", "random_wrap", "random_unwrap", "random_fold_in", "random_split", "random_clone"
)
def random_rule(node: Node, graph: Graph) -> Fixed:
    return replicated_rule(node, graph, "replicated rng")


@register("random_bits")
def random_bits_rule(node: Node, graph: Graph) -> FactorRule | Fixed:
    """Bits from one key (a dropout mask) may be generated split: with
    `jax_threefry_partitionable` (JAX's default since 0.5) each device computes only its
    block of the counters, and the values do not depend on the sharding, so the same
    key gives the same bits as `jax.jit`. Without the flag a split random_bits would
    make every device generate the whole array anyway (or, under shard_map, different
    bits), so it stays replicated. The key stays whole; only a single key (rank 0)."""
    import jax

    key = graph.values[node.inputs[0]]
    out = graph.values[node.outputs[0]]
    if not jax.config.jax_threefry_partitionable or key.rank != 0 or not out.rank:
        return replicated_rule(node, graph, "replicated rng")
    return FactorRule(
        tuple(Factor(n, name=f"d{i}") for i, n in enumerate(out.shape)),
        ((),),
        (tuple(range(out.rank)),),
    )
