"""Supervised warm start through core-rl's ``sft`` training loop (core-rl-sft): next-token loss on
format-only targets (:func:`task.format_only_answer`), then the exported model is copied into place.

The targets are written as an SFT data file (each string several times, each copy with its own
random letter order, so the model learns the format and not one fixed answer per prompt), and the
run is an ordinary ``core-rl train`` of the ``sft`` recipe: same ``fsdp`` engine, metrics and export
as any run."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

from core_rl.builtin.loggers import read_metrics
from core_rl.config.loader import load_config
from core_rl.plugins import PluginHost
from core_rl.trainer import train


def write_warm_start_data(path: Path, *, copies: int, seed: int) -> Path:
    """``copies`` rows per task string: ``{"prompt": "abc=", "response": <its letters shuffled>}``."""
    from task import all_strings, format_only_answer, prompt_text

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(copies):
            for s in all_strings():
                f.write(json.dumps({"prompt": prompt_text(s), "response": format_only_answer(s, rng)}) + "\n")
    return path


def warm_start(
    model_dir: Path, out_dir: Path, *, steps: int, batch_size: int, lr: float, seed: int, data: Path | None = None
) -> float:
    """Train ``model_dir`` for ``steps`` steps of ``batch_size`` rows with the ``sft`` loop and copy the
    exported model to ``out_dir``; return the last loss. The run itself (metrics, export) goes to
    ``out_dir.parent / "warm_start"``. ``data``: the SFT rows (``prompt``, ``response``); default:
    this task's format-only targets."""
    root = Path(out_dir).parent
    if data is None:
        from task import all_strings

        copies = max(1, math.ceil(steps * batch_size / len(all_strings())))
        data = write_warm_start_data(root / "data" / "warm_start.jsonl", copies=copies, seed=seed)
    config = root / "warm_start.yaml"
    config.write_text(
        json.dumps(
            {
                "experiment": {"name": "warm_start", "output_dir": str(root), "seed": seed},
                "data": {"train_files": [str(data)], "batch_size": batch_size},
                "actor": {"model_path": str(model_dir), "optimizer": {"name": "adamw", "lr": lr}},
                "algorithm": {"name": "sft"},
                "trainer": {"total_steps": steps, "torch_threads": 1},
                "saver": {"every_n_steps": 0, "at_end": False},
                "loggers": [],
            }
        )
    )
    host = PluginHost()
    result = train(load_config(config, host=host), host=host)
    shutil.copytree(result["export"], out_dir, dirs_exist_ok=True)
    return float(read_metrics(result["metrics"])[-1]["sft/loss"])


def warm_task(root: Path, *, num_heads: int = 4) -> dict[str, Path]:
    """The examples' layout under ``root``, as the end-to-end tests build it: ``model_init`` (a
    random tiny model over the task's letters; ``num_heads=2`` gives head size 32, the smallest
    vLLM's CPU attention runs), ``data/train.jsonl``, ``data/eval.jsonl`` and ``model_warm`` (150
    warm-start steps of 64 rows). Returns ``root``, ``model`` (the warm one) and ``data``."""
    from core_rl.tiny import build_tiny_model
    from task import LETTERS, eval_strings, write_dataset

    build_tiny_model(root / "model_init", alphabet=LETTERS + "=", seed=0, num_heads=num_heads)
    data = write_dataset(root / "data" / "train.jsonl")
    write_dataset(root / "data" / "eval.jsonl", eval_strings())
    warm_start(root / "model_init", root / "model_warm", steps=150, batch_size=64, lr=3e-3, seed=0)
    return {"root": root, "model": root / "model_warm", "data": data}
