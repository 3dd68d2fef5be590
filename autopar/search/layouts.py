"""The argument layouts the engines pin or start from: which arguments are batch-like
or optimizer state, and the specs data parallelism, ZeRO-3 (`fsdp`), ZeRO-1 within a
plan's layout, Megatron's tensor parallelism and leaner loops give them (each a map of
argument position to strategy index)."""

from __future__ import annotations

from collections.abc import Sequence

from autopar.ir.graph import BACKWARD, FORWARD
from autopar.passes.accumulate import is_accumulation
from autopar.search.build import Problem, batch_like_body_inputs
from autopar.sharding import Spec


def batch_like_inputs(problem: Problem) -> list[bool]:
    """An argument is batch-like when all its leaves have one shared leading dim
    (a batch of tokens/images/labels); parameter trees have mixed leading dims."""
    g = problem.graph
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(g.input_paths):
        groups.setdefault(p.split("/", 1)[0], []).append(i)
    out = [False] * len(g.inputs)
    for members in groups.values():
        lead = {g.values[g.inputs[i]].shape[:1] for i in members}
        if len(lead) == 1 and next(iter(lead)) != ():
            for i in members:
                out[i] = i not in problem.aliases.values()
    return out


def batch_spec(problem: Problem, i: int) -> int:
    """Strategy index sharding dim 0 over as many axes as divide it."""
    best, best_key = 0, None
    for s_i, s in enumerate(problem.strategies[i]):
        spec = s.out_specs[0]
        if any(spec.dims[1:]):
            continue
        key = (s.parallel, -s_i)
        if best_key is None or key > best_key:
            best, best_key = s_i, key
    return best


def max_sharded(problem: Problem, i: int) -> int:
    """Strategy index sharding the argument over the most devices, on as few dims as possible."""
    t = problem.graph.values[problem.graph.inputs[i]]

    def key(si):
        spec = problem.strategies[i][si].out_specs[0]
        dims = [d for d, a in enumerate(spec.dims) if a]
        return (
            problem.strategies[i][si].parallel,
            -len(dims),
            max((t.shape[d] for d in dims), default=0),
            -si,
        )

    return max(range(len(problem.strategies[i])), key=key)


def largest_dim(t) -> int | None:
    """The dim of tensor type `t` with the most entries (the first of equals); None for a
    scalar."""
    return max(range(t.rank), key=lambda k: (t.shape[k], -k)) if t.rank else None


def largest_dim_over(problem: Problem, i: int, axis: str) -> int | None:
    """Input i's strategy splitting its largest dim over `axis` alone (None if no
    strategy does, e.g. the dim does not divide)."""
    t = problem.graph.values[problem.graph.inputs[i]]
    d = largest_dim(t)
    if d is None:
        return None
    want = tuple((axis,) if k == d else () for k in range(t.rank))
    return next(
        (k for k, s in enumerate(problem.strategies[i]) if s.out_specs[0].dims == want), None
    )


def tensor_pins(problem: Problem, axis: str) -> dict[int, int]:
    """Megatron's layout with `axis` as the tensor axis, as a start for `dp`: each
    argument that is not batch-like split on its largest dim over `axis` alone (a Dense
    kernel on its wider side: column for an up projection, row for a down projection,
    the vocabulary of an embedding), each batch-like one on its leading dim over the
    other axes. Arguments with no such strategy are left free."""
    mesh = problem.mesh
    others = {a for a, n in zip(mesh.axis_names, mesh.axis_sizes) if a != axis and n > 1}
    batch = batch_like_inputs(problem)

    def batch_over(i: int) -> int | None:
        return next(
            (
                k
                for k, s in enumerate(problem.strategies[i])
                if set(s.out_specs[0].dims[0]) == others
                and not any(s.out_specs[0].dims[1:])
                and not s.out_specs[0].partial
            ),
            None,
        )

    def tied(i: int) -> bool:  # a square kernel: row or column is its neighbours' call
        shape = sorted(problem.graph.values[problem.graph.inputs[i]].shape)
        return len(shape) > 1 and shape[-1] == shape[-2]

    pins = {}
    for i in range(problem.num_inputs):
        if not batch[i] and tied(i):
            continue
        k = batch_over(i) if batch[i] else largest_dim_over(problem, i, axis)
        if k is not None:
            pins[i] = k
    return pins


def data_pins(problem: Problem) -> dict[int, int]:
    """Batch-like arguments split over the batch, the rest replicated (or as little
    split as their strategies allow: a rolled layer group keeps its stage split)."""
    batch = batch_like_inputs(problem)

    def least(i: int) -> int:
        specs = [s.out_specs[0] for s in problem.strategies[i]]
        return min(range(len(specs)), key=lambda k: (len(specs[k].used_axes), k))

    return {i: batch_spec(problem, i) if batch[i] else least(i) for i in range(problem.num_inputs)}


def replicated_plan(problem: Problem) -> list[int]:
    """Every node's first strategy that splits nothing and sums nothing (its first
    strategy where it has none): the step run whole on every device."""
    memo: dict[int, int] = {}  # per strategy table (repeated layers share theirs)

    def whole(strats) -> int:
        if id(strats) not in memo:
            memo[id(strats)] = next(
                (
                    k
                    for k, s in enumerate(strats)
                    if not any(any(sp.dims) or sp.partial for sp in (*s.in_specs, *s.out_specs))
                ),
                0,
            )
        return memo[id(strats)]

    return [whole(strats) for strats in problem.strategies]


def optimizer_state_inputs(problem: Problem) -> set[int]:
    """Input positions of optimizer state: arrays a differentiated step updates but its
    forward pass never reads (optax's moments, whatever the argument is called), and
    updated state under an `opt_state` key (the name optax train states and flax's
    TrainState use)."""
    g = problem.graph
    phase = g.phase
    grad = BACKWARD in phase

    def forward_reads(i: int) -> bool:
        return any(phase[c] == FORWARD for c in g.consumers.get(g.inputs[i], ()))

    return {
        i
        for i in problem.aliases.values()
        if g.values[g.inputs[i]].rank
        and ("opt_state" in g.input_paths[i].split("/") or (grad and not forward_reads(i)))
    }


def fsdp_pins(problem: Problem) -> dict[int, int]:
    """ZeRO-3 / FSDP: parameters and optimizer state sharded over every device."""
    batch = batch_like_inputs(problem)
    return {
        i: batch_spec(problem, i) if batch[i] else max_sharded(problem, i)
        for i in range(problem.num_inputs)
    }


def aligned_pins(problem: Problem, choice: Sequence[int], inputs: set[int]) -> dict[int, int]:
    """ZeRO over what a plan leaves replicated (Megatron's distributed optimizer): each of
    `inputs` (the optimizer state) in the layout `choice` gives it, further split by the
    mesh axes that layout leaves unused, where they divide a dim. Each device's shard is
    a slice of the one it held, so the update stays aligned with its parameter's
    tensor-parallel split; `fsdp_pins`' layout, chosen without the plan, may cross it and
    pay all-to-alls both ways every step."""
    pins = {}
    for i in inputs:
        strats = problem.strategies[i]
        base = strats[choice[i]].out_specs[0]
        ks = [k for k, s in enumerate(strats) if _refines(s.out_specs[0], base)]
        pins[i] = max(ks, key=lambda k: (strats[k].out_specs[0].shards(problem.mesh), -k))
    return pins


def _refines(spec: Spec, base: Spec) -> bool:
    """Each block of `spec` is a local slice of one of `base`'s (no sum pending)."""
    return not spec.partial and all(
        s[: len(b)] == b for s, b in zip(spec.dims, base.dims, strict=True)
    )


def loop_footprint(problem: Problem, v: int, k: int) -> int:
    """Per-device bytes of loop node `v`'s inputs other than activations (its stacked
    weights, mostly) in the layout its strategy `k` reads them."""
    node = problem.graph.nodes[v - problem.num_inputs]
    batched = set(batch_like_body_inputs(node))
    specs = problem.strategies[v][k].in_specs
    seen = {x: sp for i, (x, sp) in enumerate(zip(node.inputs, specs)) if i not in batched}
    return sum(problem.cost.local_bytes(problem.graph.values[x], sp) for x, sp in seen.items())


def loop_pins(problem: Problem, cap: float) -> dict[int, int]:
    """Each loop (a node with a body) pinned to its fastest strategy whose inputs, in
    the layout it reads them, take at most `cap` bytes per device (the leanest one
    if none does)."""
    pins = {}
    for node in problem.graph.nodes:
        v = problem.num_inputs + node.id
        if node.body is None or len(problem.strategies[v]) < 2:
            continue
        ks = range(len(problem.strategies[v]))
        size = {k: loop_footprint(problem, v, k) for k in ks}
        fits = [k for k in ks if size[k] <= cap]
        pins[v] = (
            min(fits, key=lambda k: problem.node_time[v][k]) if fits else min(ks, key=size.get)
        )
    return pins


def accumulation_pins(problem: Problem, body: str) -> dict[int, int]:
    """Each gradient accumulation loop pinned to its strategy whose body plan is named
    `body` (`search.nested`'s ZeRO bodies, "dp+zero2" and "dp+zero3"); loops that
    have none are left out."""
    pins = {}
    for node in problem.graph.nodes:
        v = problem.num_inputs + node.id
        if not is_accumulation(node):
            continue
        for k, st in enumerate(problem.strategies[v]):
            if body in st.label.removeprefix("scan body: ").split(" = "):
                pins[v] = k
    return pins
