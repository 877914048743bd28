"""core-rl-plot keeps to core-rl's public surface (:mod:`core_rl.testing.public_api`) and adds
``core-rl plot`` through the ``core_rl.commands`` entry-point group (what the command draws:
tests/test_plot.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import core_rl_plot
from core_rl.plugins import PluginHost
from core_rl.testing.public_api import private_imports


def test_the_plugin_imports_only_core_rls_public_surface() -> None:
    assert private_imports(Path(core_rl_plot.__file__).parent) == []


def test_plot_is_a_command_of_the_commands_group() -> None:
    host = PluginHost()
    assert host.load_commands() == []
    parser = argparse.ArgumentParser(prog="core-rl")
    host.pm.hook.core_rl_add_commands(subparsers=parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", "runs/a", "runs/b", "--smooth", "5"])
    assert args.run_dirs == ["runs/a", "runs/b"] and args.smooth == 5 and callable(args.run)
