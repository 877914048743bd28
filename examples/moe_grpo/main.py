"""GRPO on a tiny Qwen3-MoE on CPU, with and without routing replay (R3), printing both runs'
train/rollout mismatch and routing agreement step by step.

    python examples/moe_grpo/main.py [--workdir runs/moe_grpo] [--steps 20] [KEY=VALUE overrides]

The model (8 experts, top-2, 3 layers, random weights; :func:`core_rl.testing.tiny.build_tiny_model`
with ``architecture="qwen3_moe"``) is warm-started on the answer format of the tiny_grpo task
(reverse a 3-4 letter string), then trained twice from the same start by ``moe_grpo.yaml``: with
``actor.moe.routing_replay: rollout`` and ``none``. The rollout samples in bf16, the trainer computes
in float32, so without replay some tokens go to other experts in training than in the rollout.

Per step it prints ``mismatch/abs_logprob_diff`` (mean |train - rollout| log-prob over the response
tokens) and ``actor/moe/routing_agreement`` (the fraction of tokens whose training router, left to
itself, picks the rollout's experts). Everything goes under ``--workdir`` (replaced on each run).
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
from core_rl.testing.tiny import build_tiny_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tiny_grpo"))

from task import LETTERS, write_dataset  # noqa: E402
from warm_start import warm_start  # noqa: E402

MISMATCH = "mismatch/abs_logprob_diff"
AGREEMENT = "actor/moe/routing_agreement"


def curve(run_dir: Path, key: str) -> dict[int, float]:
    """``key`` per step of a run (steps that did not log it are left out)."""
    return {int(r["step"]): float(r[key]) for r in read_metrics(run_dir / "metrics.jsonl") if key in r}


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/moe_grpo", help="where the model, data and runs go")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps of each run")
    parser.add_argument("--warm-steps", type=int, default=60, help="supervised warm-start steps")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for both runs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    work = Path(args.workdir)
    if work.exists():
        shutil.rmtree(work)

    build_tiny_model(work / "model_init", alphabet=LETTERS + "=", architecture="qwen3_moe", num_layers=3, seed=0)
    write_dataset(work / "data" / "train.jsonl")
    loss = warm_start(work / "model_init", work / "model_warm", steps=args.warm_steps, batch_size=64, lr=3e-3, seed=0)
    print(f"warm start: {args.warm_steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.0f} s")

    runs = {}
    for mode in ("rollout", "none"):
        name = f"replay_{mode}"
        common = [f"experiment.output_dir={work}", f"experiment.name={name}", f"trainer.total_steps={args.steps}"]
        code = cli.main(
            ["train", str(HERE / "moe_grpo.yaml"), *common, f"actor.moe.routing_replay={mode}", *args.overrides]
        )
        if code != 0:
            return code
        runs[mode] = work / name

    curves = {mode: (curve(run, MISMATCH), curve(run, AGREEMENT)) for mode, run in runs.items()}
    header = ("mismatch, replay", "mismatch, off", "agreement, replay", "agreement, off")
    print("\n step  " + "  ".join(f"{h:>17}" for h in header))
    for step in range(1, args.steps + 1):
        cells = []
        for mode in ("rollout", "none"):
            value = curves[mode][0].get(step)
            cells.append(f"{value:.6f}" if value is not None else "-")
        for mode in ("rollout", "none"):
            value = curves[mode][1].get(step)
            cells.append(f"{value:.4f}" if value is not None else "-")
        print(f"{step:>5}  " + "  ".join(f"{c:>17}" for c in cells))
    on, off = (mean(list(curves[m][0].values())) for m in ("rollout", "none"))
    print(f"mean |train - rollout| log-prob: replay {on:.6f}, off {off:.6f}")
    print(f"wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
