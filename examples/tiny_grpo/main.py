"""The main job: build a tiny model, tokenizer and task offline, warm-start it on the answer
format, train it with GRPO on CPU, and report how the reward rose.

    python examples/tiny_grpo/main.py [--workdir runs/tiny_grpo] [--config grpo.yaml] [KEY=VALUE overrides]

``--config`` picks another recipe's example next to this file (``dr_grpo.yaml``, ``rloo.yaml``,
``reinforce_pp.yaml``, ``gspo.yaml``, ``dapo.yaml``, ``grpo_off_policy.yaml``).
``--config grpo_combined.yaml`` trains with a combined reward (char_match + format) and logs to
SwanLab (offline) and TensorBoard as well. The run's curves are plotted at the end (plot.png).

Everything it writes goes under ``--workdir`` (replaced on each run).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from core_rl import cli
from core_rl.builtin import read_metrics
from core_rl.errors import CoreRLError
from core_rl.testing.tiny import build_tiny_model
from core_rl_plot.plot import plot_runs
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from task import LETTERS, eval_strings, write_dataset  # noqa: E402
from warm_start import warm_start  # noqa: E402


def summarise(metrics_path: Path) -> dict[str, float]:
    """First/last-10 means of the task's reward: ``char_match``, alone or as a part of ``combine``."""
    rows = [r for r in read_metrics(metrics_path) if "reward/mean" in r]
    key = "reward/char_match/mean" if "reward/char_match/mean" in rows[0] else "reward/mean"
    rewards = [float(r[key]) for r in rows]
    steps = [float(r["timing/step_s"]) for r in rows]
    return {
        "steps": len(rows),
        "reward_first10": statistics.fmean(rewards[:10]),
        "reward_last10": statistics.fmean(rewards[-10:]),
        "seconds_per_step": statistics.fmean(steps),
        "metric": "reward" if key == "reward/mean" else key,
    }


def prepare(work: Path) -> Path:
    """One torch thread, no progress bars, and ``work`` emptied (a previous run there is replaced)."""
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    if work.exists():
        print(f"replacing the previous run in {work}")
        shutil.rmtree(work)
    return work


def plot(run_dir: Path) -> None:
    """Plot the run's curves (plot.png, plot.html) and say where they are."""
    try:
        written = plot_runs([run_dir])
        print(f"plot:       {written['png']} (and {written['html'].name})")
    except CoreRLError as exc:  # matplotlib missing
        print(f"no plot: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/tiny_grpo", help="where the model, data and run go")
    parser.add_argument("--warm-steps", type=int, default=150, help="supervised warm-start steps")
    parser.add_argument(
        "--config", default="grpo.yaml", help="the run's YAML: a path, or a file name in examples/tiny_grpo/"
    )
    parser.add_argument(
        "--num-heads", type=int, default=4, help="attention heads (2 gives head size 32, which vLLM's CPU kernels need)"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for the run's YAML")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    work = prepare(Path(args.workdir))

    build_tiny_model(work / "model_init", alphabet=LETTERS + "=", seed=0, num_heads=args.num_heads)
    write_dataset(work / "data" / "train.jsonl")
    write_dataset(work / "data" / "eval.jsonl", eval_strings())
    loss = warm_start(work / "model_init", work / "model_warm", steps=args.warm_steps, batch_size=64, lr=3e-3, seed=0)
    print(f"warm start: {args.warm_steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.0f} s")

    config = Path(args.config)
    if not config.is_file() and (HERE / config).is_file():
        config = HERE / config
    code = cli.main(["train", str(config), f"experiment.output_dir={work}", *args.overrides])
    if code != 0:
        return code
    run_dir = work / str(OmegaConf.select(OmegaConf.load(config), "experiment.name"))
    for item in args.overrides:
        if item.startswith("experiment.name="):
            run_dir = work / item.split("=", 1)[1]
    summary = summarise(run_dir / "metrics.jsonl")
    wall = time.perf_counter() - start
    print(
        f"{summary['metric']}: first 10 steps {summary['reward_first10']:.3f} -> last 10 steps "
        f"{summary['reward_last10']:.3f} "
        f"over {summary['steps']} steps; {summary['seconds_per_step']:.3f} s/step; wall time {wall:.0f} s"
    )
    evaluated = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/reward/mean" in r]
    if evaluated:
        first, last = evaluated[0], evaluated[-1]
        print(
            f"eval ({int(first['eval/prompts'])} prompts): reward {first['eval/reward/mean']:.3f} at step "
            f"{first['step']} -> {last['eval/reward/mean']:.3f} at step {last['step']}; pass@1 "
            f"{first['eval/pass@1']:.3f} -> {last['eval/pass@1']:.3f}"
        )
    met = summary["reward_last10"] >= 0.7 and summary["reward_last10"] >= 2 * summary["reward_first10"]
    print(f"goal (last-10 reward >= 0.7 and >= 2x first-10): {'met' if met else 'NOT met'}")
    plot(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
