"""Supervised warm start (:func:`core_rl.testing.tiny.warm_start`: core-rl's ``sft`` training loop) on
format-only targets (:func:`task.format_only_answer`), then the exported model is copied into place.

The targets are written as an SFT data file (each string several times, each copy with its own
random letter order, so the model learns the format and not one fixed answer per prompt), and the
run is an ordinary ``core-rl train`` of the ``sft`` recipe: same ``fsdp`` engine, metrics and export
as any run."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from core_rl.testing import tiny


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
    """:func:`core_rl.testing.tiny.warm_start` on ``data`` (default: this task's format-only targets, enough
    copies for ``steps`` steps of ``batch_size`` rows); returns the last loss."""
    root = Path(out_dir).parent
    if data is None:
        from task import all_strings

        copies = max(1, math.ceil(steps * batch_size / len(all_strings())))
        data = write_warm_start_data(root / "data" / "warm_start.jsonl", copies=copies, seed=seed)
    return tiny.warm_start(model_dir, out_dir, data, steps=steps, batch_size=batch_size, lr=lr, seed=seed)


def warm_task(root: Path, *, num_heads: int = 4) -> dict[str, Path]:
    """The examples' layout under ``root``, as the end-to-end tests build it: ``model_init`` (a
    random tiny model over the task's letters; ``num_heads=2`` gives head size 32, the smallest
    vLLM's CPU attention runs), ``data/train.jsonl``, ``data/eval.jsonl`` and ``model_warm`` (150
    warm-start steps of 64 rows). Returns ``root``, ``model`` (the warm one) and ``data``."""
    from task import LETTERS, eval_strings, write_dataset

    tiny.build_tiny_model(root / "model_init", alphabet=LETTERS + "=", seed=0, num_heads=num_heads)
    data = write_dataset(root / "data" / "train.jsonl")
    write_dataset(root / "data" / "eval.jsonl", eval_strings())
    warm_start(root / "model_init", root / "model_warm", steps=150, batch_size=64, lr=3e-3, seed=0)
    return {"root": root, "model": root / "model_warm", "data": data}
