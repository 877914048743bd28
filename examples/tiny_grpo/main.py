"""The main job: build a tiny model, tokenizer and task offline, warm-start it on the answer
format, train it with GRPO on CPU, and report how the reward rose.

    python examples/tiny_grpo/main.py [--workdir runs/tiny_grpo] [KEY=VALUE overrides for grpo.yaml]

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
from core_rl.builtin.loggers import read_metrics
from core_rl.testing.tiny import build_tiny_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from task import LETTERS, write_dataset  # noqa: E402
from warm_start import warm_start  # noqa: E402


def summarise(metrics_path: Path) -> dict[str, float]:
    rows = [r for r in read_metrics(metrics_path) if "reward/mean" in r]
    rewards = [float(r["reward/mean"]) for r in rows]
    steps = [float(r["timing/step_s"]) for r in rows]
    return {
        "steps": len(rows),
        "reward_first10": statistics.fmean(rewards[:10]),
        "reward_last10": statistics.fmean(rewards[-10:]),
        "seconds_per_step": statistics.fmean(steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/tiny_grpo", help="where the model, data and run go")
    parser.add_argument("--warm-steps", type=int, default=150, help="supervised warm-start steps")
    parser.add_argument(
        "--num-heads", type=int, default=4, help="attention heads (2 gives head size 32, which vLLM's CPU kernels need)"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for grpo.yaml")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    start = time.perf_counter()
    work = Path(args.workdir)
    if work.exists():
        print(f"replacing the previous run in {work}")
        shutil.rmtree(work)

    build_tiny_model(work / "model_init", alphabet=LETTERS + "=", seed=0, num_heads=args.num_heads)
    write_dataset(work / "data" / "train.jsonl")
    loss = warm_start(work / "model_init", work / "model_warm", steps=args.warm_steps, batch_size=64, lr=3e-3, seed=0)
    print(f"warm start: {args.warm_steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.0f} s")

    code = cli.main(["train", str(HERE / "grpo.yaml"), f"experiment.output_dir={work}", *args.overrides])
    if code != 0:
        return code
    summary = summarise(work / "grpo" / "metrics.jsonl")
    wall = time.perf_counter() - start
    print(
        f"reward: first 10 steps {summary['reward_first10']:.3f} -> last 10 steps {summary['reward_last10']:.3f} "
        f"over {summary['steps']} steps; {summary['seconds_per_step']:.3f} s/step; wall time {wall:.0f} s"
    )
    met = summary["reward_last10"] >= 0.7 and summary["reward_last10"] >= 2 * summary["reward_first10"]
    print(f"goal (last-10 reward >= 0.7 and >= 2x first-10): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
