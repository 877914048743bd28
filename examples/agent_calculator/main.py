"""Build a tiny model and the calculator task offline, warm-start the model on the format, train it
with GRPO through the ``environment`` workflow and the ``calculator`` environment on CPU, and report
how the reward rose.

    python examples/agent_calculator/main.py [--workdir runs/agent_calculator] [KEY=VALUE overrides]

Everything it writes goes under ``--workdir`` (replaced on each run); the curves are plotted at the
end (plot.png). See calc_task.py for the task.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from core_rl import cli
from core_rl.testing.tiny import build_tiny_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from calc_task import ALPHABET, write_dataset, write_warm_start_data  # noqa: E402


def tiny_grpo_main():
    """The main job's module (its set-up, warm start, summary and plot are reused here)."""
    spec = importlib.util.spec_from_file_location("tiny_grpo_main", HERE.parent / "tiny_grpo" / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/agent_calculator", help="where the model, data and run go")
    parser.add_argument("--warm-steps", type=int, default=150, help="supervised warm-start steps")
    parser.add_argument(
        "--num-heads",
        type=int,
        default=4,
        help="attention heads of the 64-wide model (2: head size 32, which vLLM's CPU attention runs)",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for calculator.yaml")
    args = parser.parse_args(argv)
    tiny = tiny_grpo_main()
    start = time.perf_counter()
    work = tiny.prepare(Path(args.workdir))

    build_tiny_model(work / "model_init", alphabet=ALPHABET, seed=0, num_heads=args.num_heads)
    write_dataset(work / "data" / "train.jsonl")
    sft = write_warm_start_data(work / "data" / "warm_start.jsonl", count=args.warm_steps * 64, seed=0)
    loss = tiny.warm_start(
        work / "model_init", work / "model_warm", steps=args.warm_steps, batch_size=64, lr=3e-3, seed=0, data=sft
    )
    print(f"warm start: {args.warm_steps} steps, final loss {loss:.3f}, {time.perf_counter() - start:.0f} s")

    code = cli.main(["train", str(HERE / "calculator.yaml"), f"experiment.output_dir={work}", *args.overrides])
    if code != 0:
        return code
    run_dir = work / "calculator"
    summary = tiny.summarise(run_dir / "metrics.jsonl")
    print(
        f"reward: first 10 steps {summary['reward_first10']:.3f} -> last 10 steps {summary['reward_last10']:.3f} "
        f"over {summary['steps']} steps; {summary['seconds_per_step']:.3f} s/step; "
        f"wall time {time.perf_counter() - start:.0f} s"
    )
    tiny.plot(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
