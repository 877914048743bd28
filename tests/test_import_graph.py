"""The core's modules import each other one way: no import cycle of any length, counting every
``import`` (at module level, inside functions and under ``TYPE_CHECKING``), and no core module
imports a plugin's package (dependencies point from plugins to the core, never back)."""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from pathlib import Path

import core_rl
import pytest

CORE = Path(core_rl.__file__).resolve().parent


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package at ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _package(name: str, path: Path) -> str:
    """The package relative imports in module ``name`` (file ``path``) are resolved against."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imported(tree: ast.Module, package: str, modules: Collection[str]) -> Iterator[tuple[str, int]]:
    """Every module an ``import`` statement of ``tree`` loads, with its line. ``from X import Y``
    loads ``X.Y`` when that is a module, else ``X`` (loading the package ``X`` before ``X.Y`` is what
    every import of ``X.Y`` does, so it is not counted). Relative imports are made absolute against
    ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base), node.lineno


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module of the same package it imports: the first line importing it}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for target, line in _imported(ast.parse(path.read_text(), str(path)), _package(name, path), modules):
            if target in modules and target != name:
                edges[target] = min(line, edges.get(target, line))
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(component: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    lines = []
    for a in component:
        for b, line in graph[a].items():
            if b in component:
                lines.append(f"  {modules[a].relative_to(CORE.parent)}:{line} imports {b}")
    return "\n".join(lines)


def test_the_core_has_no_import_cycle() -> None:
    modules = _modules(CORE)
    graph = import_graph(modules)
    found = cycles(graph)
    assert not found, "import cycles in the core:\n" + "\n\n".join(_describe(c, graph, modules) for c in found)


#: the kits a module of the conformance kit (``core_rl.testing``) may import: the contracts of the
#: engines built on a kit check that kit's layouts and server processes; only authors of such engines
#: (who depend on the kit) import them, and the rest of the core imports no kit
TESTING_MAY_IMPORT = ("core_rl_train_kit", "core_rl_server_kit")


def test_the_core_imports_no_plugin_package() -> None:
    offenders = []
    modules = _modules(CORE)
    for name, path in modules.items():
        for target, line in _imported(ast.parse(path.read_text(), str(path)), _package(name, path), modules):
            top = target.split(".")[0]
            if name.startswith("core_rl.testing.") and top in TESTING_MAY_IMPORT:
                continue
            if top.startswith("core_rl_"):
                offenders.append(f"{path.relative_to(CORE.parent)}:{line} imports {target}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        ({"a": "import pkg.b", "b": "from pkg import a"}, [["pkg.a", "pkg.b"]]),
        (
            {
                "a": "def f():\n    from pkg.b import x",
                "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import y",
                "c": "from . import a",
            },
            [["pkg.a", "pkg.b", "pkg.c"]],
        ),
        ({"a": "from pkg import b", "b": "x = 1"}, []),
        ({"__init__": "def f():\n    from pkg.a import g", "a": "from pkg import b", "b": "y = 2"}, []),
    ],
)
def test_cycles_are_found_at_any_depth_and_inside_functions(tmp_path: Path, sources: dict[str, str], expected) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    for stem, text in {"__init__": "", **sources}.items():
        (package / f"{stem}.py").write_text(text + "\n")
    assert cycles(import_graph(_modules(package))) == expected
