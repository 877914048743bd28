"""The vision-language example: build a tiny Qwen2-VL-shaped model and a picture task offline,
warm-start it on the answer format, train it with GRPO on CPU, and report how the reward rose.

    python examples/vlm_grpo/main.py [--workdir runs/vlm_grpo] [--rollout-engine sglang|vllm] [KEY=VALUE overrides]

The task (task.py): a 16x16 image with a coloured square; the prompt asks its colour; the
``exact_match`` reward is 1 for the right colour word. The warm start teaches the answer format
only (a colour drawn at random), so the reward starts near 1/4 and rises only if the policy learns
to read the image. Everything it writes goes under ``--workdir`` (replaced on each run).

``--rollout-engine sglang`` (or ``vllm``) samples through a SGLang (vLLM) CPU server instead of the
in-process ``hf`` engine (the managed ``sglang`` or ``vllm`` server environment, built on first use:
``core-rl server-env create sglang``), in float32, its weights synced over a collective after every
step (:data:`ROLLOUT_ENGINES`). For ``vllm`` the tiny model has 2 attention heads instead of 4
(:data:`MODEL_OPTIONS`: vLLM's CPU attention takes no head size below 32).
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
from core_rl.testing.tiny import warm_start
from core_rl.testing.tiny_vlm import build_tiny_vlm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from task import COLOURS, PROMPT, write_dataset, write_warm_start_data  # noqa: E402

#: the data keys every run of this task sets (rows with images need the chat template)
IMAGE_DATA = {"apply_chat_template": True}
#: the overrides of each ``--rollout-engine`` (``hf``: grpo.yaml's own)
ROLLOUT_ENGINES = {
    "hf": [],
    "sglang": ["rollout.engine.name=sglang", "rollout.engine.dtype=float32", "rollout.weight_sync=collective"],
    "vllm": ["rollout.engine.name=vllm", "rollout.engine.dtype=float32", "rollout.weight_sync=collective"],
}
#: the tiny model's options a ``--rollout-engine`` needs (vLLM's CPU attention: head size 32, not 16)
MODEL_OPTIONS: dict[str, dict[str, int]] = {"vllm": {"num_heads": 2}}


def build_task(
    work: Path, *, warm_steps: int, seed: int = 0, model_options: dict[str, int] | None = None
) -> dict[str, Path]:
    """The model, data and warm start under ``work``: ``model_init`` (random; ``model_options`` for
    :func:`build_tiny_vlm`), ``data/train.jsonl`` (256 rows), ``data/eval.jsonl`` (32 rows),
    ``model_warm`` (``warm_steps`` SFT steps of 32 rows on format-only answers). Returns the paths
    (``model``: the warm one)."""
    build_tiny_vlm(work / "model_init", words=[*COLOURS, PROMPT], seed=seed, **(model_options or {}))
    train = write_dataset(work / "data" / "train.jsonl", 256, seed=seed)
    write_dataset(work / "data" / "eval.jsonl", 32, seed=seed + 100)
    warm = write_warm_start_data(work / "data" / "warm_start.jsonl", 256, seed=seed + 200)
    loss = warm_start(
        work / "model_init",
        work / "model_warm",
        warm,
        steps=warm_steps,
        batch_size=32,
        lr=3e-3,
        seed=seed,
        data_options=IMAGE_DATA,
    )
    print(f"warm start: {warm_steps} steps, final loss {loss:.3f}")
    return {"root": work, "model": work / "model_warm", "data": train}


def summarise(metrics_path: Path) -> dict[str, float]:
    """First/last-10 means of the reward and the mean seconds per step."""
    rows = [r for r in read_metrics(metrics_path) if "reward/mean" in r]
    rewards = [float(r["reward/mean"]) for r in rows]
    return {
        "steps": len(rows),
        "reward_first10": statistics.fmean(rewards[:10]),
        "reward_last10": statistics.fmean(rewards[-10:]),
        "seconds_per_step": statistics.fmean(float(r["timing/step_s"]) for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/vlm_grpo", help="where the model, data and run go")
    parser.add_argument("--warm-steps", type=int, default=40, help="supervised warm-start steps")
    parser.add_argument("--rollout-engine", choices=sorted(ROLLOUT_ENGINES), default="hf", help="what samples")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for grpo.yaml")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    work = Path(args.workdir)
    if work.exists():
        print(f"replacing the previous run in {work}")
        shutil.rmtree(work)
    build_task(work, warm_steps=args.warm_steps, model_options=MODEL_OPTIONS.get(args.rollout_engine))
    print(f"model and warm start: {time.perf_counter() - start:.0f} s")
    engine = ROLLOUT_ENGINES[args.rollout_engine]
    code = cli.main(["train", str(HERE / "grpo.yaml"), f"experiment.output_dir={work}", *engine, *args.overrides])
    if code != 0:
        return code
    run_dir = work / "grpo"
    summary = summarise(run_dir / "metrics.jsonl")
    wall = time.perf_counter() - start
    print(
        f"reward: first 10 steps {summary['reward_first10']:.3f} -> last 10 steps {summary['reward_last10']:.3f} "
        f"over {summary['steps']} steps; {summary['seconds_per_step']:.3f} s/step; wall time {wall:.0f} s"
    )
    evaluated = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/reward/mean" in r]
    if evaluated:
        first, last = evaluated[0], evaluated[-1]
        print(
            f"eval ({int(first['eval/prompts'])} prompts): reward {first['eval/reward/mean']:.3f} at step "
            f"{first['step']} -> {last['eval/reward/mean']:.3f} at step {last['step']}"
        )
    first10, last10 = summary["reward_first10"], summary["reward_last10"]
    met = last10 >= 1.5 * first10 and last10 >= first10 + 0.3
    print(f"goal (last-10 reward >= 1.5x first-10 and >= first-10 + 0.3): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
