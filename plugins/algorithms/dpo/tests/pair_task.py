"""The tiny preference task the dpo loop's tests share: a tiny model, pairs preferring the reversed
prompt over a run of one letter of the same length (separable), and a run configuration."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import yaml
from core_rl.testing.tiny import build_tiny_model

STRINGS = ["".join(p) for n in (2, 3) for p in itertools.product("abc", repeat=n)]


def pair_task(root: Path, name: str, algorithm: dict[str, Any], trainer: dict[str, Any], saver: dict[str, Any]):
    """Write the model, ``pairs.jsonl`` and ``<name>.yaml`` under ``root``; return the paths as the
    tests' ``setup`` fixtures hand them on (``root``, ``config``, ``data``, ``model``)."""
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "pairs.jsonl"
    rows = [{"prompt": f"{s}=", "chosen": s[::-1], "rejected": "d" * len(s)} for s in STRINGS]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 5},
        "data": {"train_files": [str(data)], "batch_size": 8},
        "actor": {"model_path": str(model), "optimizer": {"name": "adamw", "lr": 3e-3}},
        "algorithm": algorithm,
        "trainer": {"total_steps": 8, "torch_threads": 1, **trainer},
        "saver": saver,
        "loggers": [{"name": "console"}],
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"root": root, "config": path, "data": data, "model": model}
