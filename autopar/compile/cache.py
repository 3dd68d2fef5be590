"""The plan cache on disk: a searched plan kept under a key of everything it depends on,
so the same call in a later process binds the plan instead of searching again (as
JAX's persistent compilation cache keeps compiled programs).

Off by default: on with `parallelize(..., cache_dir=DIR)` or `AUTOPAR_CACHE_DIR=DIR`
(`cache_dir=True`: the user cache directory, `$XDG_CACHE_HOME/autopar` or
`~/.cache/autopar`; `cache_dir=False`: off even when the variable is set). A search
writes no file anywhere unless asked, and tests and benchmarks stay hermetic.

The key (`cache_key`) hashes: the traced program (every op with its parameters, types,
name stack and source line, scan bodies and cond branches included; the argument and
result paths and types), the donated arguments and `in_specs`, every candidate mesh
(axis names, sizes, device ids, platform, abstract or not), the cluster profile, every
option that changes the search, and the code that searches (autopar's and
cost_models' source files, jax and jaxlib versions). A change to any of them is a miss;
a plan cut short by `time_limit=` is not stored. Each entry is the `Plan` pickled (with
its phase timings, the key and a hash of each part of the key; a JSON plan file loads
5-10x slower for a 58k-op plan), as JAX's cache keeps serialized executables: the
directory is trusted like the code. Any change to autopar's code is a miss, so an
entry is always read by the code that wrote it. A file that does not load or does not
carry its key is a miss.

A second, trace-free key (`source_key`) lets `.plan()` answer without tracing (a 7B
step's trace alone takes seconds): the same parts with the program replaced by a
fingerprint of the user's function (`compile.fingerprint`), the frontend's static
structure and the arguments' paths and types. It is an alias file (`*.key`) pointing
at the entry the traced key stored, written whenever a traced call stores or hits that
entry. Calls never use it: they trace, and a program the fingerprint missed a change
in misses the traced key, is searched, and the alias is repointed."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax

from autopar.ir.graph import Graph
from autopar.plan.plan import Plan

log = logging.getLogger("autopar")
ENV = "AUTOPAR_CACHE_DIR"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def cache_dir(option: str | os.PathLike | bool | None) -> Path | None:
    """The directory `cache_dir=` names: None follows AUTOPAR_CACHE_DIR (unset or empty:
    off), True is the user cache directory, False is off."""
    if option is None:
        option = os.environ.get(ENV) or False
    if option is False:
        return None
    if option is True:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "autopar"
    return Path(option).expanduser()


@functools.cache
def code_hash() -> str:
    """Hash of the code a plan comes from: autopar's and cost_models' files, jax, jaxlib."""
    import cost_models

    h = hashlib.sha256(f"jax {jax.__version__}\n".encode())
    try:
        import jaxlib

        h.update(f"jaxlib {jaxlib.__version__}\n".encode())
    except ImportError:  # pragma: no cover
        pass
    roots = [Path(__file__).resolve().parents[1], Path(cost_models.__file__).resolve().parent]
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".toml") and path.is_file():
                h.update(f"{path.relative_to(root.parent)}\n".encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def program_hash(graph: Graph) -> str:
    """Hash of a traced program: more than `plan.fingerprint` (which covers types and
    the op sequence), also every op's parameters, name stack and source line."""
    h = hashlib.sha256()
    _program(graph, h)
    return h.hexdigest()


def _program(graph: Graph, h) -> None:
    for p, v in zip(graph.input_paths, graph.inputs):
        h.update(f"in {p} {graph.values[v]}\n".encode())
    for p, v in zip(graph.output_paths, graph.outputs):
        h.update(f"out {p} {graph.values[v]} %{v}\n".encode())
    h.update(("types " + ";".join(map(str, graph.values)) + "\n").encode())
    for n in graph.nodes:
        params = ",".join(f"{k}={_param(x)}" for k, x in sorted(n.params.items()))
        types = ",".join(f"%{v}" for v in (*n.inputs, *n.outputs))
        h.update(f"{n.op}[{params}]({types}) {n.name_stack} {n.source}\n".encode())
        if n.body is not None:
            h.update(b"body\n")
            _program(n.body, h)
        for b in n.branches or ():
            h.update(b"branch\n")
            _program(b, h)


def _param(x: Any) -> str:
    if isinstance(x, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
        return "<jaxpr>"  # a scan's or cond's: hashed as the node's body or branches
    if isinstance(x, tuple) and x and isinstance(x[0], jax.extend.core.ClosedJaxpr):
        return "<jaxprs>"
    return _ADDRESS.sub("", repr(x))


def _mesh(mesh) -> list:
    names, sizes = list(mesh.axis_names), [int(s) for s in mesh.axis_sizes]
    if isinstance(mesh, jax.sharding.Mesh):
        devices = [(d.id, d.platform, getattr(d, "device_kind", "")) for d in mesh.devices.flat]
        return ["Mesh", names, sizes, devices]
    return [type(mesh).__name__, names, sizes]


def _described(options, call) -> dict:
    """Every part of a key but the program: code, arguments' roles, meshes, profile, options."""
    from autopar.search import ILP_TIME_LIMIT_S

    o = options
    return {
        "code": code_hash(),
        "donate": list(call.donate),
        "static": list(call.static),
        "in_specs": repr(call.in_specs),
        "meshes": [_mesh(m) for m in o.meshes],
        "profile": o.profile.to_dict(),
        # prices float32 dots (TF32 or float32, `cost.model.rate_dtype`)
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "options": {
            "keywords": list(o.keywords),
            "engine": o.engine,
            "memory_budget": o.memory_budget,
            "pipeline_stages": o.pipeline_stages,
            "microbatches": o.microbatches,
            "pipeline_schedule": o.pipeline_schedule,
            "virtual_stages": o.virtual_stages,
            "precision": o.precision,
            "grad_accumulation": o.grad_accumulation,
            "remat": o.remat,
            "ilp_time_limit_s": ILP_TIME_LIMIT_S,
        },
    }


def _hashed(described: dict) -> tuple[str, dict[str, str]]:
    text = lambda x: json.dumps(x, sort_keys=True, default=repr)
    parts = {k: hashlib.sha256(text(v).encode()).hexdigest()[:16] for k, v in described.items()}
    return hashlib.sha256(text(described).encode()).hexdigest()[:40], parts


def cache_key(options, call, graph: Graph) -> tuple[str, dict[str, str]]:
    """The key of one call's plan (`options`: `compile.calls.Options`, `call`: its
    `Call`, `graph`: the function traced on the call's arguments), and a hash of each
    part it is made of (kept in the entry, to tell why a later call missed)."""
    return _hashed({**_described(options, call), "program": program_hash(graph)})


def described_key(options, call) -> str:
    """The hash of every part of `cache_key` but the program."""
    return _hashed(_described(options, call))[0]


def source_key(options, call, fn, frontend_key) -> str | None:
    """The trace-free key of one call (`.plan()` only, `compile.fingerprint`): the
    parts of `cache_key` but the program, which is replaced by a fingerprint of the
    user's function `fn`, what the frontend made static (`frontend_key`: NNX graph
    definitions, pytree structures) and the arguments' paths, types and static values.
    None when `fn` cannot be fingerprinted."""
    from autopar.compile.fingerprint import fingerprint

    source = fingerprint(fn)
    if source is None:
        return None
    leaves, tree = jax.tree_util.tree_flatten_with_path(call.dyn)
    args = [
        (jax.tree_util.keystr(p), tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", "")))
        if hasattr(x, "dtype")
        else (jax.tree_util.keystr(p), type(x).__name__)
        for p, x in leaves
    ]
    statics = [_ADDRESS.sub("", repr(call.args[i])) for i in call.static]
    described = {
        **_described(options, call),
        "source": source,
        "frontend": _ADDRESS.sub("", repr(frontend_key)),
        "arguments": [str(tree), args, statics],
    }
    return "src-" + _hashed(described)[0]


class PlanCache:
    def __init__(self, directory: Path):
        self.dir = directory

    def path(self, key: str, function: str) -> Path:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", (function or "fn").split(" ")[0])[:60]
        return self.dir / f"{name}-{key}.pkl"

    def load(self, key: str, function: str) -> Plan | None:
        path = self.path(key, function)
        try:
            with open(path, "rb") as f:
                d = pickle.load(f)
            if not isinstance(d, dict) or d.get("cache_key") != key:
                raise ValueError("the file does not carry its key")
            plan = d["plan"]
            if not isinstance(plan, Plan):
                raise ValueError("the file holds no plan")
        except FileNotFoundError:
            log.info("plan cache miss: %s", path.name)
            return None
        except Exception as e:  # a broken entry is a miss
            log.warning("autopar plan cache: ignoring %s (%s)", path, e)
            return None
        log.info("plan cache hit: %s", path)
        return plan

    def alias(self, skey: str, function: str) -> Path:
        return self.path(skey, function).with_suffix(".key")

    def store_alias(self, skey: str, key: str, plan: Plan) -> None:
        """Point the trace-free key `skey` at the entry `key`, with the result's pytree
        structure (which only a trace can tell)."""
        path = self.alias(skey, plan.function)
        try:
            out_tree = pickle.dumps(plan.out_tree, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a pytree node type pickle cannot name
            out_tree = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".key")
            with os.fdopen(fd, "wb") as f:
                pickle.dump({"cache_key": key, "out_tree": out_tree}, f)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("autopar plan cache: cannot write %s (%s)", path, e)

    def load_alias(self, skey: str, function: str) -> tuple[str, Plan, Any] | None:
        """(entry key, plan, result pytree structure or None) that `skey` points at."""
        try:
            d = pickle.loads(self.alias(skey, function).read_bytes())
            key = d["cache_key"]
            out_tree = pickle.loads(d["out_tree"]) if d.get("out_tree") else None
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a broken alias is a miss
            log.warning("autopar plan cache: ignoring %s (%s)", self.alias(skey, function), e)
            return None
        plan = self.load(key, function)
        return None if plan is None else (key, plan, out_tree)

    def store(self, key: str, plan: Plan, parts: dict[str, str] | None = None) -> Path | None:
        path = self.path(key, plan.function)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            bare = replace(plan, in_tree=None, out_tree=None, jax_mesh=None, cache=None)
            d = {"cache_key": key, "cache_parts": parts or {}, "plan": bare}
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".pkl")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(d, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new
        except OSError as e:
            log.warning("autopar plan cache: cannot write %s (%s)", path, e)
            return None
        log.info("plan cache: stored %s", path)
        return path
