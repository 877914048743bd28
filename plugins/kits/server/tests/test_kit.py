"""core-rl-server-kit keeps to core-rl's public surface (:mod:`core_rl.testing.public_api`), every
module of it imports (``weight_group`` and the fingerprints are loaded by file path inside servers'
own environments, so they import nothing of core-rl), and ``core-rl server-env`` comes from it,
through the ``core_rl.commands`` entry-point group, as any plugin's command would."""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
from pathlib import Path

import core_rl_server_kit
import pytest
from core_rl.plugins import PluginHost
from core_rl.testing.public_api import private_imports

KIT = Path(core_rl_server_kit.__file__).parent


def test_the_kit_imports_only_core_rls_public_surface() -> None:
    assert private_imports(KIT) == []


@pytest.mark.parametrize("module", sorted(m.name for m in pkgutil.walk_packages([str(KIT)], "core_rl_server_kit.")))
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_the_weight_group_imports_nothing_of_core_rl() -> None:
    tree = ast.parse((KIT / "weight_group.py").read_text())
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in (n.names if isinstance(n, ast.Import) else [n])
    ]
    assert not [m for m in imported if m and m.startswith("core_rl")]


def test_server_env_is_a_command_of_the_commands_group() -> None:
    host = PluginHost()
    assert host.load_commands() == []
    parser = argparse.ArgumentParser(prog="core-rl")
    host.pm.hook.core_rl_add_commands(subparsers=parser.add_subparsers(dest="command"))
    args = parser.parse_args(["server-env", "path", "vllm", "--variant", "cpu"])
    assert args.env_command == "path" and args.name == "vllm" and callable(args.run)
