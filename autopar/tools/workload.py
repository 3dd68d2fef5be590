"""`autopar.Workload`: a function and the (abstract) arguments to plan it for.

What a TARGET factory returns to the command line (`autopar search
path/to/model.py:factory`): the function to parallelize, an example of its
arguments (arrays or, better, `jax.ShapeDtypeStruct`s, so nothing is allocated),
and which arguments are static or donated, as for `autopar.parallelize`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from autopar.errors import TargetError


@dataclass(frozen=True)
class Workload:
    """`fn(*args)` is what gets planned. `args` may hold `jax.ShapeDtypeStruct`s.

    `make_args`, optional: `make_args(seed) -> args` with concrete arrays of the same
    shapes, for running the planned function (numerics checks)."""

    fn: Callable[..., Any]
    args: tuple
    name: str = ""
    static_argnums: tuple[int, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    make_args: Callable[[int], tuple] | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Workload.fn must be callable, got {type(self.fn).__name__}")
        as_tuple = lambda x: (x,) if isinstance(x, int) else tuple(x)
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "static_argnums", as_tuple(self.static_argnums))
        object.__setattr__(self, "donate_argnums", as_tuple(self.donate_argnums))
        if not self.name:
            name = getattr(self.fn, "__qualname__", None) or getattr(self.fn, "__name__", "")
            object.__setattr__(self, "name", str(name))


_TARGET_RE = re.compile(
    r"^(?P<mod>.+?):(?P<attr>[A-Za-z_][\w.]*)\s*(?:\((?P<call>.*)\))?\s*$", re.S
)


def load_target(target: str) -> Workload:
    """`path/to/file.py:factory` or `package.module:factory` -> the Workload the factory
    returns. The factory may be called with literal arguments: `file.py:gpt(hidden=256)`.
    Raises TargetError with a one-line reason for everything that can go wrong."""
    m = _TARGET_RE.match(target)
    if not m:
        raise TargetError(
            f"bad TARGET {target!r}: expected path/to/file.py:FACTORY or package.module:FACTORY"
        )
    mod_spec, attr = m.group("mod"), m.group("attr")
    args, kwargs = _call_args(target, m.group("call"))
    module = _import(mod_spec, target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(
                n
                for n, v in vars(module).items()
                if callable(v)
                and not n.startswith("_")
                and getattr(v, "__module__", None) == module.__name__
            )
            have = f" (it defines: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''})"
            raise TargetError(
                f"TARGET {target!r}: {mod_spec} has no {attr!r}{have if names else ''}"
            )
        obj = getattr(obj, part)
    if isinstance(obj, Workload):
        if m.group("call") is not None:
            raise TargetError(f"TARGET {target!r}: {attr} is a Workload, not a factory to call")
        return obj
    if not callable(obj):
        raise TargetError(
            f"TARGET {target!r}: {attr} is a {type(obj).__name__}, not a factory returning an autopar.Workload"
        )
    try:
        wl = obj(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported in one line
        raise TargetError(
            f"TARGET {target!r}: calling {attr} failed: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(wl, Workload):
        raise TargetError(
            f"TARGET {target!r}: {attr}() returned {type(wl).__name__} {_short(wl)}, not an autopar.Workload "
            "(return autopar.Workload(fn, args, ...))"
        )
    return wl


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


def _call_args(target: str, call: str | None) -> tuple[tuple, dict]:
    if call is None or not call.strip():
        return (), {}
    try:
        node = ast.parse(f"f({call})", mode="eval").body
        assert isinstance(node, ast.Call)
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except (SyntaxError, ValueError, AssertionError) as e:
        raise TargetError(
            f"TARGET {target!r}: factory arguments must be Python literals ({type(e).__name__}: {e})"
        ) from None
    return args, kwargs


def _import(mod_spec: str, target: str) -> ModuleType:
    is_file = mod_spec.endswith(".py") or "/" in mod_spec or os.sep in mod_spec
    try:
        if is_file:
            return _import_file(mod_spec, target)
        try:
            return importlib.import_module(mod_spec)
        except ModuleNotFoundError as e:
            if e.name and mod_spec.startswith(e.name):
                raise TargetError(f"TARGET {target!r}: no module named {e.name!r}") from None
            raise
    except TargetError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module, reported in one line
        raise TargetError(
            f"TARGET {target!r}: importing {mod_spec} failed: {type(e).__name__}: {e}"
        ) from e


def _import_file(path_text: str, target: str) -> ModuleType:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise TargetError(f"TARGET {target!r}: file {path_text} does not exist")
    path = path.resolve()
    # Inside a package (every folder up has an __init__.py)? Import it by its dotted name,
    # so relative imports work and it is the same module as `import pkg.mod`.
    parts, root = [path.stem], path.parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    if len(parts) > 1:
        name = ".".join(parts)
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        mod = importlib.import_module(name)
        if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == path:
            return mod
    # A plain script: load it under a private name, with its folder importable.
    name = f"_autopar_target_{path.stem}_{abs(hash(str(path))):x}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"TARGET {target!r}: cannot load {path_text} as Python")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod
