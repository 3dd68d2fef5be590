"""The package's layer order (docs/architecture.md): a module imports only from its own
layer or lower ones, the import graph has no cycle, modules stay small, and the package
root stays a short list. Imports are read from the source (top level and inside
functions alike), so a lazy import cannot hide an upward edge."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "autopar"

# Lowest first. A module may import from any earlier layer and from its own.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("autopar.errors", "autopar.sharding", "autopar.meshes")),
    ("ir", ("autopar.ir",)),
    ("strategies", ("autopar.strategies",)),
    ("cost", ("autopar.cost",)),
    ("passes", ("autopar.passes",)),
    ("search", ("autopar.search",)),
    ("plan", ("autopar.plan",)),
    ("lower", ("autopar.lower",)),
    ("compile", ("autopar.compile",)),
    ("api", ("autopar.api", "autopar.checkpoint", "autopar.distributed", "autopar.frontends")),
    ("tools", ("autopar.tools",)),
    # Entry points: the command line, the public package and the examples built on it.
    ("front", ("autopar.cli", "autopar.__main__", "autopar", "autopar.examples")),
]


def layer_of(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (
                best is None or len(p) > len(best[1])
            ):
                best = (i, p)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: pathlib.Path) -> set[str]:
    """Every autopar module `path` imports, resolved to module names."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("autopar"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("autopar"):
                continue
            for a in node.names:  # `from autopar.x import y` may name a submodule y
                sub = f"{node.module}.{a.name}"
                known = (PKG.parent / (sub.replace(".", "/") + ".py")).exists() or (
                    PKG.parent / sub.replace(".", "/") / "__init__.py"
                ).exists()
                out.add(sub if known else node.module)
    return out


def graph(more: tuple[pathlib.Path, ...] = ()) -> nx.DiGraph:
    """The package's import graph; `more`: files read as if they were in the package
    (each named as the package file of its name, `tmp/ir/x.py` as `autopar.ir.x`)."""
    g = nx.DiGraph()
    files = [(p, module_name(p)) for p in PKG.rglob("*.py")]
    files += [(p, f"autopar.{p.parent.name}.{p.stem}") for p in more]
    for path, m in files:
        g.add_node(m)
        for dep in imports(path):
            if dep != m:
                g.add_edge(m, dep)
    return g


def test_layer_order(more: tuple[pathlib.Path, ...] = ()):
    bad = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, b in graph(more).edges
        if layer_of(b) > layer_of(a)
    ]
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    # A package's __init__ re-exporting its own modules is not a cycle of the design.
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if b.startswith(a + ".")])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"{len(cycles)} import cycles, e.g. {' -> '.join(min(cycles, key=len))}"


@pytest.mark.parametrize("limit", [620])
def test_modules_are_small(limit):
    big = {
        str(p.relative_to(ROOT)): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > limit
    }
    assert not big, f"modules over {limit} lines: {big}"


def test_package_root_is_short():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 12, root


def test_cost_models_stands_alone():
    """The cluster profiles depend on nothing in autopar."""
    for path in (ROOT / "cost_models").rglob("*.py"):
        assert not imports(path), f"{path} imports autopar"


def test_the_checks_see_a_violation(tmp_path):
    """The layer check fails on an upward import (so the tests above can fail). The
    probe is read from a temporary folder as if it were `autopar.ir._layering_probe`:
    written into the package, it broke the layer test running beside it (pytest -n)."""
    (tmp_path / "ir").mkdir()
    fake = tmp_path / "ir" / "_layering_probe.py"
    fake.write_text("from autopar.api import parallelize\n")
    with pytest.raises(AssertionError, match="_layering_probe"):
        test_layer_order((fake,))
