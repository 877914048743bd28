"""The ``core-rl`` command: ``train``, ``eval`` (:mod:`core_rl.eval.command`), ``plugins``,
``checkpoints``, ``config show`` and ``config validate``, plus the subcommands that launcher
plugins and the modules of the ``core_rl.commands`` group add (:func:`core_rl.hookspecs.core_rl_add_commands`:
``core-rl server-env`` comes from the server kit, :mod:`core_rl_server_kit.plugin`) and the ``train``
options launchers add (:func:`core_rl.hookspecs.core_rl_add_train_arguments`).

``train`` hands the run to the launcher the configuration selects (:mod:`core_rl.launch.launchers`;
``local`` by default), after its placement check; in a process a launcher started as one trainer
rank (``RANK`` and ``WORLD_SIZE`` set, as torch's elastic agent and
:func:`run_rank` sets them) it trains that rank here.

Exit status: 0 on success, 2 on a user's mistake: usage, configuration, overrides, plugins, and for
``train`` the data files, model and tokenizer directories, devices and output directory (checked
before any model is loaded). Those print a short message on stderr naming each problem, without a
traceback; any other exception is a bug and keeps its traceback. 1 when a plugin breaks its
contract (:class:`~core_rl.errors.PluginFault`: its factory or a method raised, it returned a
wrong shape, dtype or length, or it lacks a member of its interface): one line naming the component,
its distribution and version and what went wrong, then the plugin's own traceback. ``train`` also
exits with 1 when the run fails (a fault it detected, such as a broken reward or a rank that stopped
answering, as one message; anything unexpected with a traceback), 3 when SIGINT or SIGTERM stopped
it after saving a checkpoint, and 128 + N (killed by signal N) after a second signal, or when the
step did not finish within ``trainer.stop_grace_s`` of the first (stopped without saving,
:mod:`core_rl.loops.signals`). A run that makes no progress within the watchdog's bound exits
with 1 after writing every thread's stack to ``<run>/hang-<time>.txt``
(:mod:`core_rl.reliability.watchdog`). A crash of the interpreter itself (SIGSEGV and the like)
prints every thread's Python stack first (:func:`report_fatal_signals`).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core_rl import __version__
from core_rl.errors import ConfigError, CoreRLError, PluginFault, stderr_line, warn
from core_rl.reliability import exit_note

if TYPE_CHECKING:
    from core_rl.launch.rendezvous import Rendezvous
    from core_rl.plugins.host import PluginHost

EXIT_USAGE = 2
EXIT_INTERRUPTED = 3


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="path of the run's YAML file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides applied after the YAML: key.path=value (YAML value; loggers[0].name or loggers.0.name "
        "index lists; a mapping replaces the section) or ~key.path to delete a key",
    )


def build_parser(host: PluginHost | None = None) -> argparse.ArgumentParser:
    """The command line, with what the launcher plugins add to it (loaded through ``host``)."""
    from core_rl.plugins.host import PluginHost
    from core_rl.plugins.kinds import LAUNCHER

    host = host or PluginHost()
    host.load_kind(LAUNCHER)
    parser = argparse.ArgumentParser(prog="core-rl", description="RL post-training for language models.")
    parser.add_argument("--version", action="version", version=f"core-rl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train with a YAML config", description="Run training as configured.")
    train.add_argument(
        "--nproc-per-node",
        type=int,
        default=0,
        metavar="N",
        help="run N data-parallel workers on this machine (torch's elastic agent, listening on 127.0.0.1 only)",
    )
    _add_config_args(train)
    options = train.add_argument_group("launcher options")
    host.pm.hook.core_rl_add_train_arguments(group=options)
    train.set_defaults(launcher_options=[action.dest for action in options._group_actions])

    evaluate = sub.add_parser(
        "eval",
        help="evaluate a model as a config's eval section says, without training",
        description="Generate answers to the prompts of eval.files with the run's rollout engine and workflow "
        "from the model at actor.model_path (override it to evaluate a run's final_hf), score them with the run's "
        "reward and print the eval/* metrics a training run logs (pass@k, reward, per group_by value). The "
        "answers go to <run>/eval/step_<N>.jsonl. The same checks as train run first.",
    )
    _add_config_args(evaluate)
    evaluate.add_argument("--step", type=int, default=0, metavar="N", help="the step the results are labelled with")
    evaluate.add_argument("--json", action="store_true", help="print the metrics as one JSON object")

    plugins = sub.add_parser(
        "plugins",
        help="list installed plugins",
        description="List every installed plugin component: kind, name, distribution, version, "
        "description and whether it loads.",
    )
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")

    ckpt = sub.add_parser(
        "checkpoints",
        help="list a run's checkpoints, or roll the run back to one",
        description="List the checkpoints of a run directory (step, size, which one `latest` names). With "
        "--roll-back-to N, make step N's checkpoint the newest: later checkpoints move into "
        "checkpoints/rolled_back_from_<M>/ with a copy of the run's metrics (nothing is deleted), and the "
        "next `core-rl train <run>/config.yaml recover.mode=auto` continues from step N.",
    )
    ckpt.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holding checkpoints/)")
    ckpt.add_argument("--roll-back-to", type=int, default=None, metavar="N", help="the step to continue from")

    config = sub.add_parser("config", help="show, validate or look up a config", description="Inspect a configuration.")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser(
        "show",
        help="print the fully resolved YAML",
        description="Print the configuration with defaults, recipe settings, interpolations and overrides applied. "
        "Where it is not valid, print what the file, the overrides and the recipe set, each problem marked above "
        "its key (# PROBLEM:), and exit with status 2.",
    )
    _add_config_args(show)
    validate = config_sub.add_parser(
        "validate",
        help="check a config and exit 0 if it is valid",
        description="Validate the configuration, including plugin sections. With --preflight, also run the "
        "checks `train` runs before loading anything: data files, model and tokenizer directories, prompts "
        "against the tokenizer, the machine (devices, backends) and the output directory (nothing is created).",
    )
    _add_config_args(validate)
    validate.add_argument(
        "--preflight", action="store_true", help="also check data, model, tokenizer, machine and output directory"
    )
    config_sub.add_parser(
        "reference",
        help="print every configuration key (Markdown)",
        description="Print the configuration reference: every key of a run and of each installed plugin's section, "
        "with its type, default and what it accepts, generated from the configuration classes.",
    )

    for warning in host.load_commands():  # core-rl server-env (the server kit), plugins' own commands
        warn(warning)
    host.pm.hook.core_rl_add_commands(subparsers=sub)
    return parser


#: the capabilities an engine claims on its config class that ``core-rl plugins`` lists (``claims``)
LISTED_CLAIMS = ("multimodal",)


def engine_claims(entry: Any) -> list[str]:
    """The :data:`LISTED_CLAIMS` a registered plugin's config class sets true (engines: e.g. ``multimodal``)."""
    config_cls = getattr(entry, "config_cls", None)
    return [claim for claim in LISTED_CLAIMS if getattr(config_cls, claim, False) is True]


def _cmd_plugins(as_json: bool) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from core_rl.plugins.host import PluginHost

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
                "claims": ", ".join(engine_claims(entry)) if entry else "",
                "status": status,
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="core-rl plugins")
    columns = ("kind", "name", "distribution", "version", "description", "claims", "status")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:  # plain text: a description or error holding "[...]" is not console markup
        table.add_row(*(Text(row[c]) for c in columns))
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    return 0


def _cmd_checkpoints(run_dir: Path, roll_back_to: int | None) -> int:
    from core_rl.checkpoint import store as checkpoints

    if not checkpoints.checkpoints_root(run_dir).is_dir():
        raise CoreRLError(f"{run_dir}: no checkpoints/ here; give the run directory of a core-rl run")
    if roll_back_to is not None:
        aside, moved = checkpoints.roll_back(run_dir, roll_back_to)
        if aside is not None:
            names = ", ".join(p.name for p in moved)
            print(f"moved {len(moved)} later checkpoint(s) ({names}) and a copy of the metrics to {aside}")
        print(
            f"latest: {checkpoints.checkpoint_dir(run_dir, roll_back_to).name}; continue with: "
            f"core-rl train {run_dir / 'config.yaml'} recover.mode=auto"
        )
        return 0
    latest = checkpoints.latest_checkpoint(run_dir)
    found = checkpoints.list_checkpoints(run_dir)
    for step, path in found:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
        print(f"{step:>8}  {size:9.1f} MiB  {path}{'  (latest)' if path == latest else ''}")
    if not found:
        print(f"no checkpoints in {checkpoints.checkpoints_root(run_dir)}")
    for aside in sorted(checkpoints.checkpoints_root(run_dir).glob("rolled_back_from_*")):
        steps = ", ".join(str(checkpoints.step_of(p)) for p in sorted(aside.glob("step_*")))
        print(f"set aside by a roll-back: {aside} (steps {steps or 'none'})")
    return 0


def plugin_traceback(error: BaseException) -> str:
    """The traceback of a plugin's exception, from the plugin's own code: the frames of the core
    that called it (:func:`core_rl.plugins.attribution.calling`) are left out."""
    import traceback

    from core_rl.plugins import attribution

    core = {attribution.__file__}
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in core:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _note(message: str) -> None:
    """Print a note on stderr (once per job: only rank 0 of a ``torchrun`` job speaks)."""
    if os.environ.get("RANK", "0") == "0":
        stderr_line(f"core-rl: note: {message}")


def _load(args: argparse.Namespace, host: PluginHost):
    from core_rl.config import load_config

    return load_config(args.config, args.overrides, host=host, notify=_note)


def _cmd_config_show(args: argparse.Namespace, host: PluginHost) -> int:
    """Print the resolved configuration; where it is not valid, the merged one with each problem
    marked above its key (stdout), then the problems (stderr, exit status 2)."""
    from core_rl.config.loader import marked_yaml, merge_config, to_yaml, validate_merged

    merged = merge_config(args.config, args.overrides, host, notify=_note)
    checked = validate_merged(merged, host, notify=_note)
    if checked.config is None:
        sys.stdout.write(marked_yaml(checked, merged.provenance))
        sys.stdout.flush()
        raise ConfigError(checked.problems, source=merged.source)
    sys.stdout.write(to_yaml(checked.config))
    return 0


def report_fatal_signals() -> None:
    """Have a crash of the interpreter itself (SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL, e.g. in a
    native library) print every thread's Python stack to standard error before the process dies,
    so a rank lost that way says where it was. Left as it is where already on (pytest turns it on)
    or where there is no standard error to write to."""
    if faulthandler.is_enabled() or sys.__stderr__ is None:
        return
    try:
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    except (OSError, ValueError):  # a standard error without a file descriptor
        pass


def _cmd_train(args: argparse.Namespace, host: PluginHost) -> int:
    from core_rl.launch.launchers import LaunchRequest, launch_checked
    from core_rl.launch.rendezvous import Rendezvous, train_in_process

    report_fatal_signals()
    cfg = _load(args, host)
    if Rendezvous.from_env() is not None:  # one rank of a launched run
        return train_in_process(cfg, host)
    request = LaunchRequest(
        config_path=args.config,
        overrides=list(args.overrides),
        cfg=cfg,
        nproc_per_node=args.nproc_per_node or None,
        options={dest: getattr(args, dest) for dest in args.launcher_options},
        host=host,
    )
    return launch_checked(request)


def _cmd_eval(args: argparse.Namespace, host: PluginHost) -> int:
    from core_rl.eval.command import evaluate_model

    report_fatal_signals()
    result = evaluate_model(_load(args, host), host=host, step=args.step)
    if args.json:
        print(json.dumps(dict(result.metrics), allow_nan=True))
        return 0
    width = max(map(len, result.metrics))
    for key in sorted(result.metrics):
        print(f"{key:<{width}}  {result.metrics[key]:.6g}")
    print(result.summary)
    return 0


def run_rank(config_path: str, overrides: Sequence[str], rendezvous: Rendezvous) -> int:
    """Run one trainer rank of ``core-rl train config_path overrides...`` in this process and
    return its exit status, as ``core-rl train`` would (errors are printed, not raised). Every rank
    of the run calls this with the same configuration and its own ``rendezvous``; rank 0 also runs
    rollouts, rewards and loggers. Changes this process's environment (one rank per process)."""
    from core_rl.launch.rendezvous import apply

    apply(rendezvous)
    return main(["train", config_path, *overrides])


def main(argv: Sequence[str] | None = None) -> int:
    from core_rl.plugins.host import PluginHost

    host = PluginHost()
    parser = build_parser(host)
    args = parser.parse_args(argv)
    try:
        if getattr(args, "run", None) is not None:  # a plugin's subcommand
            return int(args.run(args))
        if args.command in ("plugins", "train", "eval", "config") and os.environ.get("RANK", "0") == "0":
            for stray in host.stray:  # a misspelled group: the plugin would otherwise vanish silently
                warn(stray.message())
        if args.command == "plugins":
            return _cmd_plugins(args.json)
        if args.command == "checkpoints":
            return _cmd_checkpoints(Path(args.run_dir), args.roll_back_to)
        if args.command == "config":
            if args.config_command == "show":
                return _cmd_config_show(args, host)
            if args.config_command == "reference":
                from core_rl.config.reference import reference_markdown

                print(reference_markdown(), end="")
                return 0
            from core_rl.launch.launchers import launcher_check

            cfg = _load(args, host)
            problems = launcher_check(cfg)
            if problems:
                raise ConfigError(problems, source=args.config)
            if args.preflight:
                from core_rl.loops.preflight import preflight

                preflight(cfg, create_output_dir=False)
            print(f"{args.config}: valid" + (" (preflight passed)" if args.preflight else ""))
            return 0
        if args.command == "train":
            return _cmd_train(args, host)
        if args.command == "eval":
            return _cmd_eval(args, host)
    except CoreRLError as exc:
        stderr_line(f"core-rl: {exc}" if exc.exit_code == EXIT_INTERRUPTED else f"core-rl: error: {exc}")
        exit_note.write(str(exc))  # for a launcher that reads no output (core_rl.reliability.exit_note)
        if isinstance(exc, PluginFault) and exc.__cause__ is not None:
            print(plugin_traceback(exc.__cause__), end="", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before the trainer's own handlers are installed
        stderr_line("core-rl: interrupted")
        return 128 + signal.SIGINT
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
