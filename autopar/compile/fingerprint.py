"""A fingerprint of a Python function taken without tracing it: the plan cache's second,
trace-free key (`compile.cache.source_key`), so `.plan()` of an unchanged program in a
new process answers in well under a second even where the trace alone takes seconds.

What is hashed, walking from the function:

* a function defined in the user's files: its code (bytecode, constants, names), the
  whole source file it is defined in (any edit of that file is a miss), its defaults,
  closure cells and the module globals its code names, each walked in turn;
* a class or module of the user's files: its source file;
* a function, class or module of a library (JAX, Flax, optax, ..., the standard
  library, `ir.trace_errors.is_library_file`): its qualified name and the package's version;
  a library function's closure and defaults are walked (an `optax.adamw(1e-3)` keeps
  its learning rate there);
* data (numbers, strings, containers, dataclass and plain objects' attributes, arrays'
  shapes, dtypes and bytes): its value.

What it cannot see: state the function reads that none of these reach (a global dict
mutated after definition and read through another module, a file read while tracing).
The key is therefore used only by `.plan()` (the call path always traces and uses the
traced key, so a program never *runs* on a plan made for another), and a walk that
meets something too large or too deep (more than 16 MiB of arrays, 20k objects) gives
no key at all (None: `.plan()` traces).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import types
from collections.abc import Callable

import numpy as np

from autopar.ir.trace_errors import is_library_file

MAX_OBJECTS = 20_000  # objects walked before giving up (no key)
MAX_DEPTH = 24
MAX_ARRAY_BYTES = 1 << 24  # array bytes hashed in all (closed-over constants); more: no key


class _TooBig(Exception):
    pass


def fingerprint(fn: Callable) -> str | None:
    """A hash of `fn` and what it reaches (module docstring), or None when the walk
    meets more than it can hash cheaply."""
    walker = _Walker()
    try:
        walker.visit(fn, 0)
    except (_TooBig, RecursionError):
        return None
    return walker.h.hexdigest()


@functools.lru_cache(maxsize=1024)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _file_hash(path: str | None) -> str:
    if not path or path.startswith("<"):
        return f"nofile {path}"
    try:
        st = os.stat(path)
    except OSError:
        return f"nofile {path}"
    return _file_digest(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _version(module: str) -> str:
    top = module.split(".")[0]
    try:
        return importlib.metadata.version(top)
    except Exception:  # noqa: BLE001 - stdlib modules and unpackaged ones
        return "?"


def _is_library(obj) -> bool:
    code = getattr(obj, "__code__", None)
    path = code.co_filename if code is not None else _defining_file(obj)
    return path is None or is_library_file(path)


def _defining_file(obj) -> str | None:
    if isinstance(obj, types.ModuleType):
        return getattr(obj, "__file__", None)
    module = __import__("sys").modules.get(getattr(obj, "__module__", None) or "")
    return getattr(module, "__file__", None)


class _Walker:
    def __init__(self):
        self.h = hashlib.sha256()
        self.seen: set[int] = set()
        self.count = 0
        self.array_bytes = 0

    def put(self, *parts) -> None:
        self.h.update(("\x1f".join(map(str, parts)) + "\n").encode())

    def visit(self, x, depth: int) -> None:
        self.count += 1
        if self.count > MAX_OBJECTS or depth > MAX_DEPTH:
            raise _TooBig
        if x is None or isinstance(x, bool | int | float | complex | str | bytes):
            self.put("v", type(x).__name__, repr(x))
            return
        if isinstance(x, np.generic | np.dtype):
            self.put("np", repr(x))
            return
        if isinstance(getattr(x, "shape", None), tuple) and hasattr(x, "dtype"):
            self.array(x)
            return
        if id(x) in self.seen:
            self.put("seen", type(x).__qualname__)
            return
        self.seen.add(id(x))
        if isinstance(x, tuple | list | set | frozenset):
            items = sorted(x, key=repr) if isinstance(x, set | frozenset) else x
            self.put(type(x).__qualname__, len(items))
            for item in items:
                self.visit(item, depth + 1)
        elif isinstance(x, dict):
            self.put("dict", len(x))
            for k in sorted(x, key=repr):
                self.put("key", repr(k))
                self.visit(x[k], depth + 1)
        elif isinstance(x, types.FunctionType):
            self.function(x, depth)
        elif isinstance(x, types.MethodType):
            self.visit(x.__func__, depth + 1)
            self.visit(x.__self__, depth + 1)
        elif isinstance(x, functools.partial):
            self.put("partial")
            self.visit((x.func, x.args, x.keywords), depth + 1)
        elif isinstance(x, types.ModuleType | type | types.BuiltinFunctionType):
            self.named(x)
        else:
            self.instance(x, depth)

    def array(self, x) -> None:
        shape, dtype = tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", ""))
        self.put("array", type(x).__name__, shape, dtype)
        if type(x).__name__ in ("ShapeDtypeStruct",) or "Tracer" in type(x).__name__:
            return
        self.array_bytes += int(getattr(x, "nbytes", 0) or 0)
        if self.array_bytes > MAX_ARRAY_BYTES:
            raise _TooBig
        try:
            self.put(hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest())
        except Exception:  # noqa: BLE001 - arrays that cannot be read back (deleted, remote)
            raise _TooBig from None

    def named(self, x) -> None:
        """A module, class or builtin: by its file (the user's) or name and version."""
        name = getattr(x, "__qualname__", getattr(x, "__name__", type(x).__qualname__))
        module = x.__name__ if isinstance(x, types.ModuleType) else getattr(x, "__module__", "")
        if _is_library(x):
            self.put("lib", module, name, _version(module or ""))
        else:
            self.put("user", module, name, _file_hash(_defining_file(x)))

    def function(self, f: types.FunctionType, depth: int) -> None:
        code = f.__code__
        if _is_library(f):
            self.put("libfn", f.__module__, f.__qualname__, _version(f.__module__ or ""))
        else:
            self.put("fn", f.__module__, f.__qualname__, _file_hash(code.co_filename))
            self.code(code)
            g = f.__globals__
            for name in _global_names(code):
                if name in g:
                    self.put("global", name)
                    self.visit(g[name], depth + 1)
        self.visit(f.__defaults__, depth + 1)
        self.visit(f.__kwdefaults__, depth + 1)
        for cell in f.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                value = "<empty cell>"
            self.visit(value, depth + 1)

    def code(self, code: types.CodeType) -> None:
        self.put("code", code.co_code.hex(), code.co_names, code.co_varnames)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                self.code(c)
            else:
                self.put("const", repr(c))

    def instance(self, x, depth: int) -> None:
        cls = type(x)
        self.named(cls)
        if dataclasses.is_dataclass(x):
            fields = {
                f.name: getattr(x, f.name, None)
                for f in dataclasses.fields(x)
                if f.name not in ("parent", "scope")  # flax linen's tree links
            }
            self.visit(fields, depth + 1)
        elif hasattr(x, "__dict__"):
            self.visit(dict(vars(x)), depth + 1)
        elif hasattr(x, "__slots__"):
            self.visit({s: getattr(x, s, None) for s in cls.__slots__}, depth + 1)
        else:
            self.put("repr", repr(x))


def _global_names(code: types.CodeType) -> list[str]:
    """The names `code` (and the code nested in it) reads, which may be globals."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_global_names(c))
    return list(dict.fromkeys(names))
