"""Capture: trace a function on (abstract) arguments into an `ir.Graph`.

Calls (`jit`/`pjit`, `closed_call`, `custom_jvp_call`, `custom_vjp_call`,
`checkpoint`) are inlined, so the graph is one flat list of primitives.
Structured control flow stays a single node: a `scan` node carries its body as
a graph of its own (`Node.body`, searched once for every step), a `cond` node
its branches (`Node.branches`); `while` is opaque to the strategy rules. Note: inlining `custom_jvp`/`custom_vjp`
keeps their primal computation only, so differentiate *inside* the function you
parallelize (a train step), not through it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax
import numpy as np

from autopar.errors import CaptureError
from autopar.ir import _compat
from autopar.ir.graph import Graph, Node, TensorType, body_path, check_graph
from autopar.ir.trace_errors import (
    first_lines,
    fn_name,
    is_library_file,
    trace_hint,
    user_line,
)

Site = tuple[str, str]  # (user source, library source or "") of an op, `file.py:LINE`

# primitive name -> name of the param that holds the callee jaxpr
INLINE_CALLS: dict[str, str] = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",  # `jax.checkpoint` / `nn.remat` (`ad_checkpoint.remat_p`)
}
# A checkpointed function's backward (`differentiated=True`) recomputes its forward ops;
# inlined, its recomputation reads the inputs through an `optimization_barrier`, as JAX
# lowers it, so XLA cannot merge the copies with the forward ops (which would undo the
# user's remat).
REMAT_CALLS = frozenset({"checkpoint", "remat", "remat2"})


def path_str(path: Sequence[Any], sep: str = "/") -> str:
    """`(DictKey('params'), SequenceKey(0))` -> `params/0`."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return sep.join(parts)


def _arg_names(fn: Callable, n: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n):
        if i < len(params) and params[i].kind in (
            params[i].POSITIONAL_ONLY,
            params[i].POSITIONAL_OR_KEYWORD,
        ):
            names.append(params[i].name)
        else:
            names.append(f"arg{i}")
    return names


def arg_names(fn: Callable, n: int) -> list[str]:
    """The names of `fn`'s first `n` positional parameters (`arg{i}` where it has none)."""
    return _arg_names(fn, n)


def abstractify(x: Any) -> Any:
    """An array-like leaf -> ShapeDtypeStruct (sharding dropped, weak type kept: a
    Python int a step returned as `n + 1` stays the weakly typed scalar `jax.jit`
    traced it as); others unchanged."""
    weak = bool(getattr(x, "weak_type", False))
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=weak)
    return x


def leaf_signature(x: Any) -> tuple:
    """What a leaf of `abstractify_tree`'s result traces as: (shape, dtype, weak) for
    an array and for a Python scalar (a weakly typed scalar, as `jax.jit` takes it, so
    `TrainState.create`'s `step=0` and the array the step returns for it are one
    signature); the type's name for any other leaf."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return (tuple(x.shape), str(x.dtype), bool(x.weak_type))
    if isinstance(x, bool | int | float | complex):
        return ((), str(jax.dtypes.canonicalize_dtype(np.asarray(x).dtype)), True)
    return ("py", type(x).__name__)


def capture(
    fn: Callable,
    args: Sequence[Any],
    static_argnums: Sequence[int] = (),
    mesh: Any = None,
    keywords: Sequence[str] = (),
) -> Graph:
    """Trace `fn(*args)` into a Graph. `args` may hold arrays or ShapeDtypeStructs;
    the last `len(keywords)` of them are passed by those names (keyword-only
    parameters). With `mesh`, tracing runs under `jax.set_mesh(mesh)`, so bare
    PartitionSpecs in the function's own `with_sharding_constraint` calls resolve
    against it."""
    static = set(static_argnums)
    dyn_idx = [i for i in range(len(args)) if i not in static]
    n_pos = len(args) - len(keywords)
    names = _arg_names(fn, n_pos) + list(keywords)
    dyn_args = tuple(abstractify_tree(args[i]) for i in dyn_idx)

    def flat_fn(*dyn):
        full = list(args)
        for i, a in zip(dyn_idx, dyn):
            full[i] = a
        return fn(*full[:n_pos], **dict(zip(keywords, full[n_pos:])))

    try:
        with _mesh_context(mesh):
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_args)
    except Exception as e:  # noqa: BLE001 - re-raised with the user's function named
        shapes = ", ".join(_describe(a) for a in dyn_args)
        where = user_line(e)
        raise CaptureError(
            f"autopar could not trace {fn_name(fn)} on arguments ({shapes}):\n"
            f"  {type(e).__name__}: {first_lines(e, fn, [names[i] for i in dyn_idx])}\n"
            + (f"  raised at {where}\n" if where else "")
            + trace_hint(fn, e, [args[i] for i in dyn_idx], [names[i] for i in dyn_idx])
        ) from e

    leaves, in_tree = jax.tree_util.tree_flatten_with_path(dyn_args)
    input_paths = tuple(
        path_str((_Name(names[dyn_idx[p[0].idx]]),) + tuple(p[1:])) for p, _ in leaves
    )
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    output_paths = tuple(path_str((_Name("out"),) + tuple(p)) for p, _ in out_leaves)
    return _build(closed, input_paths, output_paths, in_tree, out_tree, fn_name(fn))


def _mesh_context(mesh: Any):
    if mesh is None:
        return contextlib.nullcontext()
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return jax.sharding.use_abstract_mesh(mesh)
    return jax.set_mesh(mesh)


class _Name:
    def __init__(self, name: str):
        self.name = name


_KEY_IMPLS = {"key<fry>": "threefry2x32", "key<rbg>": "rbg", "key<urbg>": "unsafe_rbg"}


def abstract_value(t: TensorType, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """A captured value's abstract array (at `shape`, default its own); a typed PRNG key
    as one (the graph keeps its uint32 words' dtype and the key type's name), so a pass
    that traces the step again keeps the key a key."""
    shape = t.shape if shape is None else shape
    if t.extended in _KEY_IMPLS:
        impl = _KEY_IMPLS[t.extended]
        dtype = jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, t.dtype)


def abstractify_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(abstractify, tree)


def _describe(tree: Any) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) == 1 and hasattr(leaves[0], "shape"):
        return f"{leaves[0].dtype}{list(leaves[0].shape)}"
    return f"<pytree of {len(leaves)} leaves>"


@functools.lru_cache(maxsize=65536)
def _tensor_type(shape: tuple, dtype: Any) -> TensorType:
    try:
        dt = np.dtype(np.float32 if dtype is None else dtype)
    except TypeError:  # extended dtypes (PRNG keys): priced as their uint32 words
        return TensorType(tuple(int(d) for d in shape), np.dtype(np.uint32), str(dtype))
    return TensorType(tuple(int(d) for d in shape), dt)


class _Builder:
    def __init__(self):
        self.values: list[TensorType] = []
        self.nodes: list[Node] = []
        self.consts: dict[int, Any] = {}

    def new_value(self, aval) -> int:
        self.values.append(_tensor_type(getattr(aval, "shape", ()), getattr(aval, "dtype", None)))
        return len(self.values) - 1

    def new_value_like(self, v: int) -> int:
        self.values.append(self.values[v])
        return len(self.values) - 1

    def const(self, value, aval) -> int:
        v = self.new_value(aval)
        self.consts[v] = value
        return v

    def barrier(self, ins: list[int], prevent_cse, stack: str, site: Site, eqn) -> list[int]:
        """`ins` with those `prevent_cse` marks (a bool for all, or one per input) read
        through `optimization_barrier` nodes (constants excepted), one per input: JAX
        puts them all behind one, which stops CSE the same way, but a mesh axis can
        shard only one tensor of a barrier (`strategies.elementwise.identity_tuple_rule`),
        so a layer's weights behind one barrier would all be gathered but one."""
        marks = (prevent_cse,) * len(ins) if isinstance(prevent_cse, bool) else prevent_cse
        held = list(dict.fromkeys(v for v, m in zip(ins, marks) if m and v not in self.consts))
        if not held:
            return ins
        outs = [self.new_value_like(v) for v in held]
        src = _source(eqn, site)
        for v, out in zip(held, outs):
            self.nodes.append(
                Node(
                    id=len(self.nodes),
                    op="optimization_barrier",
                    inputs=(v,),
                    outputs=(out,),
                    primitive=jax.lax.optimization_barrier_p,
                    params={},
                    name_stack=stack,
                    source=src[0],
                    library_source=src[1],
                )
            )
        swap = dict(zip(held, outs))
        return [swap.get(v, v) for v in ins]

    def inline(
        self, jaxpr, consts, in_ids: Sequence[int], stack: str, site: Site = ("<unknown>", "")
    ) -> list[int]:
        """Append `jaxpr`'s eqns, calls inlined. `site` is the source (user line, library
        line) of the call being inlined: eqns with no frame of their own (inside library
        jits such as `jnp.linalg.eigh`) point there instead."""
        env: dict[Any, int] = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.const(c, var.aval)
        for var, v in zip(jaxpr.invars, in_ids):
            env[var] = v

        def read(x) -> int:
            if isinstance(x, _compat.Literal):
                return self.const(x.val, x.aval)
            return env[x]

        for eqn in jaxpr.eqns:
            ins = [read(x) for x in eqn.invars]
            name = eqn.primitive.name
            inner_stack = _join(stack, _compat.eqn_name_stack(eqn))
            if name in INLINE_CALLS and INLINE_CALLS[name] in eqn.params:
                callee = eqn.params[INLINE_CALLS[name]]
                if isinstance(callee, _compat.ClosedJaxpr):
                    sub, sub_consts = callee.jaxpr, callee.consts
                else:
                    sub, sub_consts = callee, ()
                if name in ("pjit", "jit") and eqn.params.get("name"):
                    inner_stack = _join(inner_stack, str(eqn.params["name"]))
                if name in REMAT_CALLS and eqn.params.get("differentiated"):
                    ins = self.barrier(
                        ins, eqn.params.get("prevent_cse", True), inner_stack, site, eqn
                    )
                outs = self.inline(sub, sub_consts, ins, inner_stack, _source(eqn, site))
                for var, v in zip(eqn.outvars, outs):
                    env[var] = v
                continue
            if name == "reshard" and _identity_reshard(eqn):
                env[eqn.outvars[0]] = ins[0]
                continue
            src = _source(eqn, site)
            body = _scan_body(eqn, inner_stack, src) if name == "scan" else None
            branches = _cond_branches(eqn, inner_stack, src) if name == "cond" else None
            outs = [self.new_value(var.aval) for var in eqn.outvars]
            for var, v in zip(eqn.outvars, outs):
                if not isinstance(var, _compat.DropVar):
                    env[var] = v
            self.nodes.append(
                Node(
                    id=len(self.nodes),
                    op=name,
                    inputs=tuple(ins),
                    outputs=tuple(outs),
                    primitive=eqn.primitive,
                    params=dict(eqn.params),
                    name_stack=inner_stack,
                    source=src[0],
                    library_source=src[1],
                    body=body,
                    branches=branches,
                )
            )
        return [read(x) for x in jaxpr.outvars]


def _identity_reshard(eqn) -> bool:
    """A `jax.sharding.reshard` that lowers to nothing: to a mesh whose axes are all Auto
    (what jnp and flax insert under a mesh: NNX's dropout reshards its key to its
    input's sharding). Left out of the graph, so a step traces to the same graph under
    autopar's mesh (one mesh asked for) as without one (`mesh=N`), and a plan made one
    way binds the other."""
    mesh = getattr(eqn.params.get("dst_sharding"), "mesh", None)
    return mesh is None or getattr(mesh, "are_all_axes_auto", False) or mesh.empty


def _scan_body(eqn, stack: str, site: Site) -> Graph:
    """A scan's body jaxpr as a graph; paths name the loop's roles (`graph.body_path`)."""
    closed = eqn.params["jaxpr"]
    n_c, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    n_in, n_out = len(closed.jaxpr.invars), len(closed.jaxpr.outvars)
    roles_in = ["const"] * n_c + ["carry"] * n_carry + ["x"] * (n_in - n_c - n_carry)
    roles_out = ["carry"] * n_carry + ["y"] * (n_out - n_carry)
    k_in = [i - roles_in.index(r) for i, r in enumerate(roles_in)]
    k_out = [i - roles_out.index(r) for i, r in enumerate(roles_out)]
    return _subgraph(
        closed,
        stack,
        site,
        [body_path(r, k) for r, k in zip(roles_in, k_in)],
        [body_path(r, k) for r, k in zip(roles_out, k_out)],
        f"scan body at {site[0]}",
    )


def _cond_branches(eqn, stack: str, site: Site) -> tuple[Graph, ...]:
    """A cond's branches as graphs of its operands (the inputs after the branch index),
    with paths `branchK/inN` and `branchK/outN`."""
    return tuple(
        _subgraph(
            closed,
            stack,
            site,
            [f"branch{k}/in{i}" for i in range(len(closed.jaxpr.invars))],
            [f"branch{k}/out{i}" for i in range(len(closed.jaxpr.outvars))],
            f"cond branch {k} at {site[0]}",
        )
        for k, closed in enumerate(eqn.params["branches"])
    )


def _subgraph(closed, stack: str, site: Site, in_paths, out_paths, name: str) -> Graph:
    """A closed jaxpr called by a structured control-flow op, as a graph of its own."""
    b = _Builder()
    in_ids = [b.new_value(v.aval) for v in closed.jaxpr.invars]
    out_ids = b.inline(closed.jaxpr, closed.consts, in_ids, stack, site)
    g = Graph(
        values=tuple(b.values),
        nodes=tuple(b.nodes),
        inputs=tuple(in_ids),
        input_paths=tuple(in_paths),
        outputs=tuple(out_ids),
        output_paths=tuple(out_paths),
        consts=b.consts,
        name=name,
    )
    check_graph(g)
    return g


def _source(eqn, site: Site) -> Site:
    """(`file.py:LINE` of the first frame that made `eqn` outside JAX, Flax, optax,
    transformers and autopar; the frame JAX names when that one is a library's, else
    ""). An eqn with no frame outside JAX takes the call site's."""
    first = None
    for file, where in _compat.eqn_frames(eqn):
        if first is None:
            first = where
        if not is_library_file(file):
            return (where, "" if where is first else first)
    if first is None:
        return site
    # all library: the call site's user line, when there is one
    return (site[0], first) if site[0] != "<unknown>" else (first, "")


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a and b else a or b


def _build(closed, input_paths, output_paths, in_tree, out_tree, name) -> Graph:
    b = _Builder()
    jaxpr = closed.jaxpr
    in_ids = [b.new_value(v.aval) for v in jaxpr.invars]
    out_ids = b.inline(jaxpr, closed.consts, in_ids, "")
    g = Graph(
        values=tuple(b.values),
        nodes=tuple(b.nodes),
        inputs=tuple(in_ids),
        input_paths=input_paths,
        outputs=tuple(out_ids),
        output_paths=output_paths,
        consts=b.consts,
        in_tree=in_tree,
        out_tree=out_tree,
        name=name,
    )
    check_graph(g)
    return g


def append_traced(
    values: list[TensorType],
    nodes: list[Node],
    consts: dict[int, Any],
    fn: Callable,
    in_ids: Sequence[int],
    name_stack: str,
    source: str,
) -> list[int]:
    """Trace `fn` on the types of values `in_ids` and append its ops to a graph under
    construction (`values`, `nodes` and `consts` are extended in place), each with
    `name_stack` and `source`; the value ids of `fn`'s results. For graph passes
    that insert small computations (`autopar.passes.precision`'s float16 range scales)."""
    closed = _traced(fn, tuple((values[v].shape, values[v].dtype) for v in in_ids))
    b = _Builder()
    b.values, b.nodes, b.consts = values, nodes, consts
    start = len(nodes)
    outs = b.inline(closed.jaxpr, closed.consts, in_ids, "")
    for i in range(start, len(nodes)):
        nodes[i] = replace(nodes[i], name_stack=name_stack, source=source)
    return outs


@functools.lru_cache(maxsize=4096)
def _traced(fn: Callable, avals: tuple) -> Any:
    """`fn`'s jaxpr on arguments of these (shape, dtype)s, traced once per pair (a pass
    inserts the same small computation at every contraction of a model)."""
    return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, d) for s, d in avals))


def lines_from(graph: Graph, ref: Sequence[Node]) -> Graph:
    """`graph` (traced again from `ref`'s ops through autopar's evaluator, so its ops'
    lines are autopar's) with each op's user line and name stack taken from the `ref`
    op it was made from: aligned in order, skipping `ref` ops that tracing elided (a
    cast to the dtype a value already has); unchanged when they do not align."""
    j, nodes = 0, []
    for b in graph.nodes:
        while j < len(ref) and ref[j].op != b.op:
            j += 1
        if j == len(ref):
            return graph
        o = ref[j]
        j += 1
        nodes.append(
            replace(b, source=o.source, name_stack=o.name_stack, library_source=o.library_source)
        )
    return replace(graph, nodes=tuple(nodes))
