"""What capture says when a trace fails, and which frames are the user's: the hint chosen
by what went wrong (`trace_hint`), the error's first lines in the user's names
(`first_lines`), and the library test that skips JAX's, Flax's, optax's and autopar's
own frames (`is_library_file`; an op's `source` and an error's line use it)."""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar.errors import did_you_mean


def fn_name(fn: Callable) -> str:
    """`fn`'s name and where it is defined; a wrapper's (`jax.grad(f)`, anything
    `functools.wraps` made) is where the function it wraps is."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    try:
        inner = inspect.unwrap(fn)
    except ValueError:  # a cycle of __wrapped__
        inner = fn
    code = getattr(inner, "__code__", None)
    where = f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code else ""
    return f"{name}{where}"


# Packages whose frames are not the user's: an op's `source` and an error's line skip them
# (autopar's example models count as user code).
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "transformers", "equinox", "chex", "autopar")


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(directories of the packages in LIBRARIES and the standard library, directories
    exempt from them)."""
    import importlib.util
    import os
    import sysconfig

    dirs = []
    for name in LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for d in (spec.submodule_search_locations or ()) if spec else ():
            dirs.append(os.path.realpath(d) + os.sep)
    for key in ("stdlib", "platstdlib"):
        dirs.append(os.path.realpath(sysconfig.get_paths()[key]) + os.sep)
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return tuple(dirs), (os.path.join(here, "examples") + os.sep,)


@functools.lru_cache(maxsize=4096)
def is_library_file(filename: str) -> bool:
    """Whether `filename` belongs to JAX, Flax, optax, transformers, autopar (not its
    examples) or the standard library, rather than to the user."""
    import os

    if filename.startswith("<"):  # <frozen ...>, <string>: not a line the user can open
        return not filename.startswith("<stdin") and filename != "<string>"
    path = os.path.realpath(filename)
    libs, exempt = _library_dirs()
    if path.startswith(exempt):
        return False
    return path.startswith(libs)


def user_frame_of(exc: BaseException):
    """The innermost traceback frame of `exc` in the user's code (a `FrameSummary`), or
    None."""
    import traceback

    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        if not is_library_file(f.filename):
            return f
    return None


_CONCRETE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)
# `argument dyn[0]['n']` / `at path dyn[0]['n']` in JAX's messages (capture traces `*dyn`)
_ARG_RE = re.compile(r"(?:argument|at path) dyn\[(\d+)\]((?:\[[^\]]*\]|\.\w+)*)")


def user_line(e: BaseException) -> str | None:
    """Where in the user's code `e` was raised: `file:line in function: the line` of the
    innermost frame of its traceback outside the libraries (`is_library_file`), or
    None when it has none (the error came from JAX checking the arguments)."""
    tb, found = e.__traceback__, None
    while tb is not None:
        if not is_library_file(tb.tb_frame.f_code.co_filename):
            found = tb
        tb = tb.tb_next
    if found is None:
        return None
    code = found.tb_frame.f_code
    text = linecache.getline(code.co_filename, found.tb_lineno).strip()
    where = f"{os.path.basename(code.co_filename)}:{found.tb_lineno} in {code.co_name}"
    return where + (f": {text}" if text else "")


def first_lines(e: BaseException, fn: Callable, names: Sequence[str]) -> str:
    """JAX's message without the sentences about autopar's own wrapper (`flat_fn`), the
    arguments named as the user named them."""
    text = re.sub(
        r"The error occurred while tracing the function flat_fn at \S+ for \w+\. ?", "", str(e)
    )
    text = re.sub(r"<function capture\.<locals>\.flat_fn at 0x[0-9a-f]+>", fn_name(fn), text)
    text = re.sub(
        r"\bdyn\[(\d+)\]",
        lambda m: names[int(m.group(1))] if int(m.group(1)) < len(names) else m.group(0),
        text,
    )
    return "\n  ".join(ln for ln in text.splitlines() if ln.strip())


def _unbound_linen_module(fn: Any, e: BaseException) -> bool:
    if type(e).__module__.startswith("flax") and "Unbound" in type(e).__name__:
        return True
    fn = getattr(fn, "__wrapped__", fn)
    for c in type(fn).__mro__:
        if c.__name__ == "Module" and c.__module__.startswith("flax.linen"):
            return getattr(fn, "scope", None) is None
    return False


def _leaf_at(tree: Any, sub: str) -> Any:
    """The leaf of `tree` at a JAX key path string such as `['n']` or `[0].x`."""
    for m in re.finditer(r"\[('?)(.*?)\1\]|\.(\w+)", sub):
        key = m.group(3) if m.group(3) is not None else m.group(2)
        try:
            if m.group(3) is not None:
                tree = getattr(tree, key)
            elif isinstance(tree, dict):
                tree = tree[key] if key in tree else tree[int(key)]
            else:
                tree = tree[int(key)]
        except (KeyError, IndexError, ValueError, AttributeError, TypeError):
            return None
    return tree


def _inner_python_leaves(dyn_args: Sequence[Any], names: Sequence[str]) -> list:
    """(path, value) of every Python scalar inside a dict/list argument."""
    out = []
    for k, a in enumerate(dyn_args):
        for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
            if path and isinstance(x, int | float | complex | bool):
                out.append((names[k] + jax.tree_util.keystr(path), x))
    return out


def trace_hint(
    fn: Callable, e: BaseException, dyn_args: Sequence[Any], names: Sequence[str]
) -> str:
    """What to do about `e`, raised tracing `fn` on `dyn_args` (the non-static arguments,
    named `names`): chosen by what went wrong."""
    if _unbound_linen_module(fn, e):
        cls = fn_name(fn).split(" (")[0]
        return (
            f"{cls} is an unbound flax.linen Module: pass `model.apply` as the function and "
            f"the variables as its first argument, e.g. parallelize(model.apply, mesh=...)"
            f"(variables, x), with variables = model.init(key, x)."
        )
    axis = re.search(r"Resource axis: (\S+) of .* is not found in mesh: \(([^)]*)\)", str(e))
    if axis:
        have = re.findall(r"'([^']*)'", axis.group(2))
        return (
            f"A sharding constraint names the axis {axis.group(1)!r}, which the mesh lacks"
            f"{did_you_mean(axis.group(1), have)}; the mesh's axes are {tuple(have)}."
        )
    m = _ARG_RE.search(str(e))
    where, sub, leaf = None, "", None
    if m and int(m.group(1)) < len(names):
        k, sub = int(m.group(1)), m.group(2)
        where = names[k] + sub
        leaf = _leaf_at(dyn_args[k], sub) if sub else dyn_args[k]
    concrete = isinstance(e, _CONCRETE) or (
        isinstance(e, IndexError) and "must be static" in str(e)
    )
    if sub and not hasattr(leaf, "shape"):  # a Python value inside a dict/list
        inner = [(where, leaf)]
    elif m is None and concrete:  # JAX did not say which: every Python scalar inside one
        inner = _inner_python_leaves(dyn_args, names)
    else:
        inner = []
    fix = None
    if inner:
        what = ", ".join(f"{p} (a Python {type(x).__name__})" for p, x in inner[:3])
        fix = (
            f"{what} {'is' if len(inner) == 1 else 'are'} inside an argument, and "
            "static_argnums cannot reach inside a dict or list: autopar traces every leaf of "
            "a non-static argument, as jax.jit does. Make it an array if it is data, or "
            "close over it (a closure or functools.partial) if it is a setting."
        )
    if concrete:
        f = user_frame_of(e)
        lines = ["A traced value is used as a concrete Python value"]
        if f is not None:
            lines[0] += f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno}:"
            lines.append(f"    {(f.line or '').strip()}")
        else:
            lines[0] += "."
        if fix:
            lines.append(fix)
        else:
            lines.append(
                "Under tracing an argument has a shape and dtype but no value: branch on it "
                "with jnp.where or jax.lax.cond (keep float(...), int(...) and .item() "
                "outside the function), or, if it is a setting rather than data, pass it "
                "as a static argument (static_argnums / static_argnames)."
            )
        return "\n".join(lines)
    if fix:
        return fix
    return (
        "Check that the function runs under jax.jit with these shapes; pass Python "
        "scalars/configs through static_argnums."
    )
