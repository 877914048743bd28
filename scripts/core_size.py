"""How big the core is, and how much of it plugins lean on: the figures issue 54 asks a note to give.

    python scripts/core_size.py [--rev REV] [--root DIR]

Prints, for ``core/core_rl`` of the working tree (or of the commit ``REV``, read with ``git
archive``): per concept folder (``(top)``: the modules directly in ``core_rl``) the modules and the
lines, split into code, docstrings, comments and blank lines, then the totals with and without
``testing/`` (the testing kit, which issue 54 leaves out of the core's budget); the lines of the
kits (``plugins/kits/*/src``) and of the other plugins' sources; and the core names the plugins'
sources import (``from core_rl.X import name``; ``import core_rl.X`` counts the module), with the
modules they come from.

A line is a docstring line when it belongs to a string statement (a module's, class's or
function's docstring, or an attribute's), a comment line when it holds only a comment, blank when it
holds only whitespace, and code otherwise.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import subprocess
import sys
import tarfile
import tokenize
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import PurePosixPath

#: the kinds of line, in the order the table prints them
KINDS = ("code", "doc", "comment", "blank")


def line_kinds(source: str) -> Counter[str]:
    """How many lines of ``source`` (Python) are code, docstrings, comments and blank (see the
    module docstring)."""
    lines = source.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    comment: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and lines[token.start[0] - 1].lstrip().startswith("#"):
            comment.add(token.start[0])
    kinds: Counter[str] = Counter({kind: 0 for kind in KINDS})
    for number, line in enumerate(lines, 1):
        if not line.strip():
            kinds["blank"] += 1
        elif number in doc:
            kinds["doc"] += 1
        elif number in comment:
            kinds["comment"] += 1
        else:
            kinds["code"] += 1
    return kinds


def core_imports(source: str) -> Iterator[tuple[str, str]]:
    """``(module, name)`` for each core name ``source`` imports (``name`` is ``""`` for ``import
    core_rl.X``; a ``from core_rl import X`` gives ``("core_rl", "X")``)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "core_rl" or node.module.startswith("core_rl."):
                for alias in node.names:
                    yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "core_rl" or alias.name.startswith("core_rl."):
                    yield alias.name, ""


class Tree:
    """The Python files of a repository's working tree or of one of its commits, by POSIX path."""

    def __init__(self, root: str, rev: str | None) -> None:
        self.files: dict[str, str] = {}
        if rev is None:
            listed = subprocess.run(
                ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split("\0")
            for path in filter(None, listed):  # NUL-separated: a path may hold spaces
                try:
                    with open(f"{root}/{path}", encoding="utf-8") as handle:
                        self.files[path] = handle.read()
                except FileNotFoundError:  # deleted, not yet staged
                    continue
        else:
            archive = subprocess.run(["git", "-C", root, "archive", rev], capture_output=True, check=True).stdout
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                for member in tar.getmembers():
                    if member.isfile() and member.name.endswith(".py"):
                        handle = tar.extractfile(member)
                        assert handle is not None
                        self.files[member.name] = handle.read().decode("utf-8")

    def under(self, prefix: str) -> Iterable[tuple[str, str]]:
        return ((path, text) for path, text in sorted(self.files.items()) if path.startswith(prefix))


def folder_of(path: str, root: str = "core/core_rl/") -> str:
    """The concept folder of a core module (``(top)`` for the modules directly in the package)."""
    parts = PurePosixPath(path[len(root) :]).parts
    return parts[0] if len(parts) > 1 else "(top)"


@dataclasses.dataclass
class Figures:
    """Every figure the table prints."""

    folders: dict[str, Counter[str]]  # per concept folder: modules, lines and each kind of line
    kits: Counter[str]  # modules and lines of the kits' sources
    plugins: Counter[str]  # modules and lines of the other plugins' sources
    imported: set[tuple[str, str]]  # the core names the plugins' sources import (core_imports)

    @property
    def total(self) -> Counter[str]:
        return sum(self.folders.values(), Counter())

    @property
    def without_testing(self) -> Counter[str]:
        return self.total - self.folders.get("testing", Counter())


def measure(tree: Tree) -> Figures:
    """The figures of ``tree``."""
    figures = Figures({}, Counter(), Counter(), set())
    for path, text in tree.under("core/core_rl/"):
        counts = figures.folders.setdefault(folder_of(path), Counter())
        counts.update(line_kinds(text))
        counts.update(modules=1, lines=len(text.splitlines()))
    for path, text in tree.under("plugins/"):
        if "/src/" in path:
            part = figures.kits if path.startswith("plugins/kits/") else figures.plugins
            part.update(modules=1, lines=len(text.splitlines()))
            figures.imported.update(core_imports(text))
    return figures


def table(figures: Figures) -> str:
    """The figures as the script prints them."""
    head = f"{'folder':<16}{'modules':>8}{'lines':>8}" + "".join(f"{kind:>9}" for kind in KINDS)

    def row(name: str, counts: Counter[str]) -> str:
        cells = "".join(f"{counts[kind]:>9}" for kind in KINDS)
        return f"{name:<16}{counts['modules']:>8}{counts['lines']:>8}{cells}"

    folders = figures.folders
    rows = [head, "-" * len(head)]
    rows += [row(name, folders[name]) for name in sorted(folders, key=lambda n: (-folders[n]["lines"], n))]
    rows += ["-" * len(head), row("all", figures.total), row("without testing", figures.without_testing)]
    kits, plugins = figures.kits, figures.plugins
    rows.append(f"kits: {kits['modules']} modules, {kits['lines']} lines")
    rows.append(f"other plugins' sources: {plugins['modules']} modules, {plugins['lines']} lines")
    modules = Counter(module for module, _ in figures.imported)
    names = sum(1 for _, name in figures.imported if name)
    rows.append(f"plugins import {names} core names from {len(modules)} core modules:")
    rows += [f"  {count:>4} {module}" for module, count in sorted(modules.items(), key=lambda m: (-m[1], m[0]))]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", help="a commit to measure instead of the working tree")
    parser.add_argument("--root", default=".", help="the repository (default: the current directory)")
    args = parser.parse_args(argv)
    try:
        tree = Tree(args.root, args.rev)
    except subprocess.CalledProcessError as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        print(f"core_size.py: error: {' '.join(exc.cmd)} failed: {stderr.strip()}", file=sys.stderr)
        return 2
    print(table(measure(tree)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
