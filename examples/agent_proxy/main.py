"""Build a tiny model and the calculator task offline, train the agent (agent.py) through the
OpenAI proxy with GRPO on CPU, and report how the reward rose.

    python examples/agent_proxy/main.py [--workdir runs/agent_proxy] [KEY=VALUE overrides]

Everything it writes goes under ``--workdir`` (replaced on each run); the curves are plotted at the
end (plot.png, as ``core-rl plot`` draws them).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from proxy_task import ALPHABET, CHAT_TEMPLATE, write_dataset  # noqa: E402


def reward_curve(run_dir: Path) -> tuple[list[float], float]:
    """The run's ``reward/mean`` per step and its mean seconds per step."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    return [float(r["reward/mean"]) for r in rows], statistics.fmean(float(r["timing/step_s"]) for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/agent_proxy", help="where the model, data and run go")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for agent.yaml")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    start = time.perf_counter()
    work = Path(args.workdir).resolve()
    if work.exists():
        print(f"replacing the previous run in {work}")
        shutil.rmtree(work)
    build_tiny_model(work / "model", alphabet=ALPHABET, seed=0)
    write_dataset(work / "data" / "train.jsonl")
    code = cli.main(
        [
            "train",
            str(HERE / "agent.yaml"),
            f"experiment.output_dir={work}",
            f"rollout.workflow.program={HERE / 'agent.py'}:solve",
            f"rollout.workflow.chat_template={CHAT_TEMPLATE}",
            *args.overrides,
        ]
    )
    if code != 0:
        return code
    run_dir = work / "agent_proxy"
    rewards, step_s = reward_curve(run_dir)
    k = max(1, len(rewards) // 4)
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    print(
        f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} over {len(rewards)} steps; "
        f"{step_s:.3f} s/step; wall time {time.perf_counter() - start:.0f} s"
    )
    try:
        written = plot_runs([run_dir])
        print(f"plot:       {written['png']} (and {written['html'].name})")
    except CoreRLError as exc:  # matplotlib missing
        print(f"no plot: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
