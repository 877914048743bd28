"""The ``core-rl`` command: ``train``, ``plugins``, ``config show``, ``config validate`` and
``server-env create|list|path|remove`` (:mod:`core_rl.server_env`).

Exit status: 0 on success, 2 on a usage, configuration or plugin error (a short message on stderr,
no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from core_rl import __version__
from core_rl.errors import CoreRLError

EXIT_USAGE = 2


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="path of the run's YAML file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides applied after the YAML, e.g. actor.optimizer.lr=1e-5",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="core-rl", description="RL post-training for language models.")
    parser.add_argument("--version", action="version", version=f"core-rl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train with a YAML config", description="Run training as configured.")
    _add_config_args(train)

    plugins = sub.add_parser(
        "plugins",
        help="list installed plugins",
        description="List every installed plugin component: kind, name, distribution, version, "
        "description and whether it loads.",
    )
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")

    config = sub.add_parser("config", help="show or validate a config", description="Inspect a configuration.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser(
        "show",
        help="print the fully resolved YAML",
        description="Print the configuration with defaults, recipe settings, interpolations and overrides applied.",
    )
    _add_config_args(show)
    validate = config_sub.add_parser(
        "validate",
        help="check a config and exit 0 if it is valid",
        description="Validate the configuration, including plugin sections.",
    )
    _add_config_args(validate)

    from core_rl.server_env import add_command as add_server_env_command

    add_server_env_command(sub)
    return parser


def _cmd_plugins(as_json: bool) -> int:
    from rich.console import Console
    from rich.table import Table

    from core_rl.plugins import PluginHost

    host = PluginHost()
    statuses = host.load_all()
    rows = []
    for st in statuses:
        entry = host.registries[st.kind.key].get(st.name)
        status = st.status if not st.error else f"{st.status}: {st.error}"
        if entry is not None and st.status == "loaded" and entry.distribution != st.distribution:
            status = f"overridden by {entry.distribution}"
        rows.append(
            {
                "kind": st.kind.label,
                "name": st.name,
                "distribution": st.distribution,
                "version": st.version,
                "description": entry.description if entry else "",
                "status": status,
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="core-rl plugins")
    for column in ("kind", "name", "distribution", "version", "description", "status"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(row[c] for c in ("kind", "name", "distribution", "version", "description", "status")))
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    return 0


def _load(args: argparse.Namespace):
    from core_rl.config import load_config
    from core_rl.plugins import PluginHost

    host = PluginHost()
    return host, load_config(args.config, args.overrides, host=host)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plugins":
            return _cmd_plugins(args.json)
        if args.command == "server-env":
            from core_rl.server_env import run_command

            return run_command(args)
        if args.command == "config":
            _, cfg = _load(args)
            if args.config_command == "show":
                from core_rl.config import to_yaml

                sys.stdout.write(to_yaml(cfg))
            else:
                print(f"{args.config}: valid")
            return 0
        if args.command == "train":
            from core_rl.trainer import train

            host, cfg = _load(args)
            train(cfg, host=host)
            return 0
    except CoreRLError as exc:
        print(f"core-rl: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
