"""Frontends: what `jax.jit`, `nnx.jit` and `eqx.filter_jit` accept, bound into the pure
function of arrays that autopar traces.

`bind` turns one call into a `Bound`: the call's arguments as *slots* (the positional
ones, then those passed by keyword, each under its parameter's name), which of them are
static, and a `Program`, the pure function the driver captures in place of the user's:

- jax.jit parity: defaults the caller did not pass are not traced at all (the function
  applies them itself); a value passed by keyword with no array in it (`train=True`,
  `mutable=False`, `method=...`) is static, as are `static_argnums` / `static_argnames`;
  Python scalars passed positionally stay traced.
- Flax NNX: graph nodes (modules, optimizers, `Rngs`) anywhere in the arguments are split
  into one graphdef (static) and their state as nested dicts of arrays named by the
  state's paths (`model/l1/kernel`); the program merges them, calls the function, and
  returns the new state, which `Program.finish` writes back into the caller's objects,
  as `nnx.jit` does.
- Equinox: the non-array leaves of an `eqx.Module` (activation functions, Python
  scalars) are static, as `eqx.filter_jit` has them, and modules in the results come back
  with their static parts (recorded while tracing).

Neither flax nor equinox is imported here: a graph node or an `eqx.Module` can only be
an argument if the user imported them, so they are looked up in `sys.modules`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from autopar.errors import AutoparError, did_you_mean
from autopar.ir.capture import abstractify, fn_name

__all__ = ["Bound", "Program", "Unwrapped", "bind", "check_static_argnames", "unwrap"]


# ---- jit wrappers -----------------------------------------------------------------------


@dataclass(frozen=True)
class Unwrapped:
    """A function without its jit wrappers, the static arguments they named, and whether
    one was `eqx.filter_jit` (every non-array leaf static, as filter_jit has it)."""

    fn: Callable
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    filtered: bool = False
    donate_argnums: tuple[int, ...] = ()  # a `jax.jit`'s (its argnames resolved)
    dropped: str = ""  # a wrapper's option not carried over, named for a warning


def unwrap(fn: Callable) -> Unwrapped:
    """`fn` without its `jax.jit` / `nnx.jit` / `eqx.filter_jit` wrappers (autopar is
    the jit), keeping the static arguments they were given and `jax.jit`'s donated
    ones. Other `functools.wraps`
    decorators are kept: they may do work of their own."""
    argnums: tuple[int, ...] = ()
    argnames: tuple[str, ...] = ()
    donated: tuple[int, ...] = ()
    dropped = ""
    filtered = False
    as_tuple = lambda x: () if x is None else (x,) if isinstance(x, int | str) else tuple(x)
    for _ in range(16):
        kind = type(fn)
        module = getattr(kind, "__module__", "") or ""
        if kind.__name__ == "PjitFunction" and hasattr(fn, "__wrapped__"):
            info = getattr(fn, "_jit_info", None)  # jax.jit's own record of its options
            argnums += as_tuple(getattr(info, "static_argnums", None))
            argnames += as_tuple(getattr(info, "static_argnames", None))
            donated += as_tuple(getattr(info, "donate_argnums", None))
            fn = fn.__wrapped__
        elif module.startswith("flax.nnx") and kind.__name__.endswith("JitWrapped"):
            argnums += as_tuple(getattr(fn, "static_argnums", None))
            jitted = getattr(fn, "jitted_fn", None)
            info = getattr(jitted, "_jit_info", None)
            argnames += as_tuple(getattr(info, "static_argnames", None))
            if as_tuple(getattr(info, "donate_argnums", None)):
                dropped = "nnx.jit's donate_argnums"
            fn = getattr(fn, "fun", None) or fn.__wrapped__
        elif module.startswith("equinox") and kind.__name__ == "_JitWrapper":
            filtered = True
            fn = fn.__wrapped__
        else:
            break
    return Unwrapped(
        fn,
        tuple(dict.fromkeys(argnums)),
        tuple(dict.fromkeys(argnames)),
        filtered,
        tuple(dict.fromkeys(donated)),
        dropped,
    )


def check_static_argnames(fn: Callable, names: Sequence[str]) -> tuple[str, ...]:
    """`static_argnames` as a tuple, each name checked against `fn`'s parameters (any
    name goes where it has `**kwargs`)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    sig = _signature(fn)
    if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return names
    params = [p.name for p in sig.parameters.values() if p.kind is not p.VAR_POSITIONAL]
    for name in names:
        if name not in params:
            raise AutoparError(
                f"static_argnames={names!r}: {fn_name(fn)} has no parameter {name!r}"
                f"{did_you_mean(name, params)} (its parameters: {', '.join(params)})"
            )
    return names


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return None


# ---- what a leaf is ----------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def is_graph_node(x: Any) -> bool:
    nnx_graph = sys.modules.get("flax.nnx.graph")
    return nnx_graph is not None and not _is_array(x) and nnx_graph.is_graph_node(x)


def graph_nodes(tree: Any) -> list:
    """The NNX graph nodes (modules, optimizers) among `tree`'s leaves, each once, in
    order: what a step may update in place."""
    seen: dict[int, Any] = {}
    for x in jax.tree_util.tree_leaves(tree, is_leaf=is_graph_node):
        if is_graph_node(x):
            seen.setdefault(id(x), x)
    return list(seen.values())


def _is_eqx_module(x: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def _is_node(x: Any) -> bool:
    return is_graph_node(x) or _is_eqx_module(x)


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


@dataclass(frozen=True)
class _Filtered:
    """A subtree whose non-array leaves are static: its treedef, which leaves are
    arrays, and the static leaves (None where an array goes)."""

    treedef: Any
    mask: tuple[bool, ...]
    static: tuple[Any, ...]

    @staticmethod
    def split(tree: Any) -> tuple[Any, _Filtered]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        mask = tuple(_is_array(x) for x in leaves)
        dyn = jax.tree_util.tree_unflatten(
            treedef, [x if m else None for x, m in zip(leaves, mask)]
        )
        static = tuple(None if m else x for x, m in zip(leaves, mask))
        return dyn, _Filtered(treedef, mask, static)

    def combine(self, dyn: Any) -> Any:
        arrays = iter(jax.tree_util.tree_leaves(dyn))
        leaves = [next(arrays) if m else s for m, s in zip(self.mask, self.static)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def key(self) -> Any:
        return (self.treedef, self.mask, tuple(_hashable(s) for s in self.static))


@dataclass(frozen=True)
class _Tree:
    """How one slot (or the result) was made pure: its treedef down to the graph nodes
    and Equinox modules, and per such leaf None (as is), ("nnx", k) (input graph node k),
    ("out", graphdef, template) (a new graph node) or a `_Filtered`."""

    treedef: Any
    tops: tuple[Any, ...]

    def key(self) -> Any:
        return (
            self.treedef,
            tuple(t.key() if isinstance(t, _Filtered) else _nnx_key(t) for t in self.tops),
        )


def _nnx_key(t: Any) -> Any:
    if t is None or t[0] == "nnx":
        return t
    return ("out", t[1])  # the template follows from the graphdef


# ---- binding ------------------------------------------------------------------------------


@dataclass
class Bound:
    """One call through the frontend: the slots' values as autopar traces them (static
    ones as given), which are static, the donated flat leaves, `in_specs` over the
    dynamic slots, the cache key of everything static, the `Program` to trace, and the
    caller's graph nodes (their state is written back after the call)."""

    args: tuple
    static: tuple[int, ...]
    donate: tuple[int, ...]
    in_specs: Any
    key: Any
    program: Program
    nodes: tuple


def bind(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    *,
    static_argnums: Sequence[int],
    static_argnames: Sequence[str],
    donate_argnums: Sequence[int],
    in_specs: Any,
    filtered: bool = False,
) -> Bound:
    """Bind one call of `fn` (see the module docstring for what is static)."""
    name = fn_name(fn)
    sig = _signature(fn)
    named: list[str] = []
    if sig is None:
        pos_values, kw = list(args), dict(kwargs)
        pos_names = [f"arg{i}" for i in range(len(args))]
    else:
        try:
            bound = sig.bind(*args, **kwargs)
        except (TypeError, ValueError) as e:  # Python's reason, with the function named
            raise AutoparError(f"{name}: cannot bind the arguments: {e}") from None
        pos_values, kw = list(bound.args), dict(bound.kwargs)
        named = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        pos_names = [named[i] if i < len(named) else f"arg{i}" for i in range(len(pos_values))]
    n_pos = len(pos_values)
    static_pos = set(_norm(static_argnums, n_pos))
    names = set(static_argnames)
    if sig is not None:  # argnums name the positional parameters there, as in jax.jit
        names |= {named[i] for i in static_argnums if 0 <= i < len(named)}
    values = [*pos_values, *kw.values()]
    slot_names = [*pos_names, *kw]
    static = []
    for i, (slot, v) in enumerate(zip(slot_names, values)):
        if i in static_pos or slot in names:
            static.append(i)
        elif (i >= n_pos or slot in kwargs) and not any(
            _is_array(x) or is_graph_node(x)
            for x in jax.tree_util.tree_leaves(v, is_leaf=is_graph_node)
        ):
            static.append(i)  # a keyword argument without arrays: static, as jax.jit's defaults
    # graph nodes and Equinox modules, in every dynamic slot
    nodes: list = []
    trees: list[_Tree | None] = []
    pure: list = []
    for i, v in enumerate(values):
        if i in static:
            trees.append(None)
            pure.append(v)
            continue
        p, t = _split_slot(v, nodes, filtered)
        trees.append(t)
        pure.append(p)
    graph, state = _NnxInputs.split(nodes) if nodes else (None, {})
    pure = [_fill(p, t, state) for p, t in zip(pure, trees)]
    program = Program(fn, name, slot_names, n_pos, tuple(trees), graph)
    donate = _flat_donate(pure, static, set(_norm(donate_argnums, n_pos)))
    n_dyn = len(values) - len(static)
    n_dyn_pos = sum(i not in static for i in range(n_pos))
    if isinstance(in_specs, tuple | list) and len(in_specs) == n_dyn_pos < n_dyn:
        in_specs = (*in_specs, *[None] * (n_dyn - n_dyn_pos))  # the keyword ones searched
    key = (
        tuple(slot_names),
        n_pos,
        tuple(t.key() if t is not None else None for t in trees),
        graph.graphdef if graph is not None else None,
    )
    return Bound(tuple(pure), tuple(static), donate, in_specs, key, program, tuple(nodes))


def _norm(argnums: Sequence[int], n: int) -> tuple[int, ...]:
    """Argument positions as jax.jit reads them: negative ones count from the end."""
    return tuple(i % n for i in argnums if -n <= i < n)


def _flat_donate(args: Sequence, static: Sequence[int], donate: set[int]) -> tuple[int, ...]:
    out, pos = [], 0
    for i, a in enumerate(args):
        if i in static:
            continue
        n = len(jax.tree_util.tree_leaves(a))
        if i in donate:
            out.extend(range(pos, pos + n))
        pos += n
    return tuple(out)


def _fill(pure_tops: Any, tree: _Tree | None, state: dict) -> Any:
    """A slot's pure value: its tops (from `_split_slot`) with each graph node's state."""
    if tree is None:
        return pure_tops
    tops = [
        state.get(d[1], {}) if isinstance(d, tuple) and d[0] == "nnx" else p
        for p, d in zip(pure_tops, tree.tops)
    ]
    return jax.tree_util.tree_unflatten(tree.treedef, tops)


def _split_slot(value: Any, nodes: list, filtered: bool) -> tuple[Any, _Tree | None]:
    """One dynamic slot made pure: graph nodes become ("nnx", k) markers (filled with
    their state once every slot is split, so shared references are split once) and
    Equinox modules keep only their arrays. None when the slot has neither."""
    tops, treedef = jax.tree_util.tree_flatten(value, is_leaf=_is_node)
    if not filtered and not any(_is_node(t) for t in tops):
        return value, None
    out, descs = [], []
    for t in tops:
        if is_graph_node(t):
            descs.append(("nnx", len(nodes)))
            nodes.append(t)
            out.append(None)
        elif filtered or _is_eqx_module(t):
            dyn, f = _Filtered.split(t)
            descs.append(f)
            out.append(dyn)
        else:
            descs.append(None)
            out.append(t)
    return out, _Tree(treedef, tuple(descs))


@dataclass(frozen=True)
class _NnxInputs:
    """The caller's graph nodes split once: the graphdef (static), an abstract template
    of their state (to rebuild the `State` from pure dicts while tracing), which nodes
    have state of their own (a node passed twice has it once) and the pure state's tree
    structure. No arrays: the program outlives the call."""

    graphdef: Any
    template: Any
    present: frozenset
    structure: Any

    @staticmethod
    def split(nodes: list) -> tuple[_NnxInputs, dict]:
        """The split and each node's pure state (its arrays, nested dicts named by the
        state's paths)."""
        from flax import nnx  # the user's arguments hold graph nodes: flax is imported

        graphdef, state = nnx.split(tuple(nodes))
        template = jax.tree_util.tree_map(abstractify, state)
        pure = nnx.to_pure_dict(state)
        structure = jax.tree_util.tree_structure(pure)
        return _NnxInputs(graphdef, template, frozenset(pure), structure), pure

    def merge(self, pure: dict) -> tuple:
        """The graph nodes rebuilt from their pure state (inside the trace)."""
        from flax import nnx

        state = jax.tree_util.tree_map(lambda x: x, self.template)  # fresh Variables
        nnx.replace_by_pure_dict(state, pure)
        return nnx.merge(self.graphdef, state)


# ---- the program ---------------------------------------------------------------------------


class Program:
    """The pure function autopar traces for one argument signature: rebuilds the
    arguments (graph nodes merged, Equinox modules combined with their static leaves),
    calls the user's function, and returns its result made pure, plus the graph nodes'
    new state when there are any. `finish` undoes that on the program's outputs."""

    def __init__(self, fn, name, slot_names, n_pos, trees, graph: _NnxInputs | None):
        self.fn, self.name, self.n_pos = fn, name, n_pos
        self.slot_names, self.trees, self.graph = list(slot_names), trees, graph
        self.keywords = tuple(slot_names[n_pos:])
        self.out_tree: _Tree | None = None  # recorded while tracing
        # where the function adds or removes Variables (`sow`, `nnx.pop`): the new
        # state's abstract template and the paths it removed, recorded while tracing
        self.reshaped: tuple[Any, tuple] | None = None
        # what `ir.capture` reads: the parameter names and the user's function's name
        kind = inspect.Parameter
        params = [
            kind(_ident(n, i), kind.POSITIONAL_ONLY) for i, n in enumerate(slot_names[:n_pos])
        ]
        params += [kind(n, kind.KEYWORD_ONLY) for n in self.keywords]
        self.__signature__ = inspect.Signature(params)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__code__ = getattr(fn, "__code__", None)
        self.__wrapped__ = fn  # for capture's hints; __signature__ stops inspect.unwrap

    def __call__(self, *pos, **kw):
        values = [*pos, *(kw[n] for n in self.keywords)]
        merged = ()
        if self.graph is not None:
            pure = {}
            for v, t in zip(values, self.trees):
                if t is not None:
                    for p, d in zip(t.treedef.flatten_up_to(v), t.tops):
                        if isinstance(d, tuple) and d[0] == "nnx" and d[1] in self.graph.present:
                            pure[d[1]] = p
            merged = self.graph.merge(pure)
        real = [_restore(v, t, merged) for v, t in zip(values, self.trees)]
        out = self.fn(*real[: self.n_pos], **dict(zip(self.keywords, real[self.n_pos :])))
        out_pure, self.out_tree = _split_out(out, merged)
        if self.graph is None:
            return out_pure
        from flax import nnx

        state = nnx.state(merged)
        new = nnx.to_pure_dict(state)
        self.reshaped = None
        if jax.tree_util.tree_structure(new) != self.graph.structure:
            # Variables added (`sow`) or removed (`nnx.pop`): written back as `nnx.jit`
            # does, the new ones added to the caller's nodes, the removed ones popped
            before = {p for p, _ in nnx.to_flat_state(self.graph.template)}
            after = {p for p, _ in nnx.to_flat_state(state)}
            self.reshaped = (
                jax.tree_util.tree_map(abstractify, state),
                tuple(sorted(before - after, key=str)),
            )
        return out_pure, new

    def finish(self, outs: Any, nodes: tuple) -> Any:
        """The user's result from the program's outputs; the caller's graph nodes get
        their new state."""
        if self.graph is not None:
            from flax import nnx

            outs, new = outs
            if self.reshaped is None:
                state = nnx.state(nodes)
            else:
                template, removed = self.reshaped
                state = jax.tree_util.tree_map(lambda x: x, template)  # fresh Variables
                if removed:
                    gone = set(removed)
                    nnx.pop(nodes, lambda path, _: tuple(path) in gone)
            nnx.replace_by_pure_dict(state, new)
            nnx.update(nodes, state)
        tree = self.out_tree
        if tree is None:
            return outs
        tops = []
        for p, d in zip(tree.treedef.flatten_up_to(outs), tree.tops):
            if isinstance(d, _Filtered):
                tops.append(d.combine(p))
            elif d is None:
                tops.append(p)
            elif d[0] == "nnx":
                tops.append(nodes[d[1]])  # an argument returned: the caller's object
            else:
                from flax import nnx

                state = jax.tree_util.tree_map(lambda x: x, d[2])
                nnx.replace_by_pure_dict(state, p)
                tops.append(nnx.merge(d[1], state))
        return jax.tree_util.tree_unflatten(tree.treedef, tops)


def _ident(name: str, i: int) -> str:
    return name if name.isidentifier() else f"arg{i}"


def _restore(value: Any, tree: _Tree | None, merged: tuple) -> Any:
    if tree is None:
        return value
    tops = []
    for p, d in zip(tree.treedef.flatten_up_to(value), tree.tops):
        if d is None:
            tops.append(p)
        elif isinstance(d, _Filtered):
            tops.append(d.combine(p))
        else:
            tops.append(merged[d[1]])
    return jax.tree_util.tree_unflatten(tree.treedef, tops)


def _split_out(out: Any, merged: tuple) -> tuple[Any, _Tree | None]:
    """The result made pure: graph nodes that are arguments drop out (their state goes
    back through the arguments), new ones become their pure state, Equinox modules keep
    their arrays."""
    tops, treedef = jax.tree_util.tree_flatten(out, is_leaf=_is_node)
    if not any(_is_node(t) for t in tops):
        return out, None
    pure, descs = [], []
    for t in tops:
        k = next((k for k, n in enumerate(merged) if n is t), None)
        if k is not None:
            descs.append(("nnx", k))
            pure.append(None)
        elif is_graph_node(t):
            from flax import nnx

            graphdef, state = nnx.split(t)
            descs.append(("out", graphdef, jax.tree_util.tree_map(abstractify, state)))
            pure.append(nnx.to_pure_dict(state))
        elif _is_eqx_module(t):
            dyn, f = _Filtered.split(t)
            descs.append(f)
            pure.append(dyn)
        else:
            descs.append(None)
            pure.append(t)
    return jax.tree_util.tree_unflatten(treedef, pure), _Tree(treedef, tuple(descs))
