"""Registration of ``core-rl server-env create|list|path|remove`` (entry point group
``core_rl.commands``): the command that builds and manages the virtual environments inference
servers run from (:mod:`core_rl_server_kit.env`)."""

from __future__ import annotations

import argparse

from core_rl.hookspecs import hookimpl


@hookimpl
def core_rl_add_commands(subparsers: argparse._SubParsersAction) -> None:
    from core_rl_server_kit.env import add_command, run_command

    add_command(subparsers).set_defaults(run=run_command)
