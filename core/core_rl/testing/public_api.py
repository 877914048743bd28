"""The public surface of core-rl for plugin authors, and the check that a plugin imports nothing else.

A plugin (an in-repo one, a kit, an example, a third party's) may import:

- anything under the public trees (:data:`PUBLIC_TREES`): the contracts (:mod:`core_rl.interfaces`),
  the configuration schema and its checks (:mod:`core_rl.config`), the shared math
  (:mod:`core_rl.ops`), this conformance kit (:mod:`core_rl.testing`) and the two kits
  (``core_rl_train_kit``, ``core_rl_server_kit``);
- the public modules (:data:`PUBLIC_MODULES`), each as a whole;
- from a public package (:data:`PUBLIC_PACKAGES`) the names of its ``__all__``, and only those.

Everything else in ``core_rl`` is the core's own and may change without notice. A third party keeps
its plugin to this surface with one test::

    from core_rl.testing.public_api import private_imports

    def test_my_plugin_imports_only_core_rls_public_api():
        assert private_imports(Path(my_plugin.__file__).parent) == []
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

#: every module under these is public
PUBLIC_TREES = (
    "core_rl.interfaces",
    "core_rl.config",
    "core_rl.ops",
    "core_rl.testing",
    "core_rl.vision",
    "core_rl_train_kit",
    "core_rl_server_kit",
)
#: modules public as a whole (any name they define)
PUBLIC_MODULES = (
    "core_rl",
    "core_rl.hookspecs",
    "core_rl.protocol",
    "core_rl.errors",
    "core_rl.cli",
    "core_rl.checkpoint.files",
    "core_rl.launch.distributed",
    "core_rl.roles.hf",
    "core_rl.roles.lora",
    "core_rl.reliability.exit_note",
    "core_rl.sync.buckets",
    "core_rl.sync.fingerprint",
)
#: packages whose ``__all__`` is public (imported from the package itself, never from its modules)
PUBLIC_PACKAGES = (
    "core_rl.builtin",
    "core_rl.checkpoint",
    "core_rl.data",
    "core_rl.launch",
    "core_rl.loops",
    "core_rl.loops.supervised",
    "core_rl.plugins",
    "core_rl.reliability",
    "core_rl.roles",
    "core_rl.rollout",
    "core_rl.sync",
)


def is_public_module(module: str) -> bool:
    """Whether ``module`` may be imported as a whole (a public tree's module or a public module)."""
    return module in PUBLIC_MODULES or any(module == t or module.startswith(t + ".") for t in PUBLIC_TREES)


def _is_core(module: str) -> bool:
    top = module.split(".")[0]
    return top == "core_rl" or top in ("core_rl_train_kit", "core_rl_server_kit")


def _public_names(package: str) -> frozenset[str]:
    return frozenset(getattr(importlib.import_module(package), "__all__", ()))


def import_problem(module: str, name: str | None) -> str | None:
    """Why ``from module import name`` (``name`` ``None``: ``import module``) reaches past the public
    surface, or ``None`` where it does not."""
    if not _is_core(module) or is_public_module(module):
        return None
    if module in PUBLIC_PACKAGES:
        if name is None:
            return None
        if name in _public_names(module) or is_public_module(f"{module}.{name}"):
            return None
        return f"{name!r} is not in {module}.__all__"
    if name is not None and is_public_module(f"{module}.{name}"):
        return None
    owner = next((p for p in sorted(PUBLIC_PACKAGES, key=len, reverse=True) if module.startswith(p + ".")), None)
    hint = f"; import it from {owner}" if owner else ""
    return f"{module} is internal to core-rl{hint}"


def private_imports(source: Path) -> list[str]:
    """``file:line: what`` for every import under ``source`` (a package directory or one file) that
    reaches past core-rl's public surface; empty when the plugin keeps to it."""
    files = [source] if source.is_file() else sorted(source.rglob("*.py"))
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in targets:
                problem = import_problem(module, name)
                if problem:
                    found.append(f"{path}:{node.lineno}: {problem}")
    return found
