"""Registration of ``core-rl plot RUN_DIR [RUN_DIR ...]`` (entry point group ``core_rl.commands``):
training curves of one or several runs, overlaid (:mod:`core_rl_plot.plot`)."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from core_rl_plot.plot import plot_runs

    written = plot_runs(args.run_dirs, out_dir=args.out, smooth=args.smooth)
    print(f"plot: {written['png']}")
    print(f"page: {written['html']}")
    return 0


from core_rl.hookspecs import hookimpl  # noqa: E402


@hookimpl
def core_rl_add_commands(subparsers: argparse._SubParsersAction) -> None:
    plot = subparsers.add_parser(
        "plot",
        help="plot training curves of runs",
        description="Plot reward, KL, entropy, response length, clip fraction, grad norm, learning rate, "
        "step time split and throughput against the step for one or more runs (overlaid), as plot.png and "
        "plot.html next to the first run's metrics.jsonl.",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    plot.add_argument("--out", default=None, help="write the files here instead of the first run directory")
    plot.add_argument("--smooth", type=int, default=None, help="rolling-mean window in steps (default ~steps/50)")
    plot.set_defaults(run=_run)
