"""Five GRPO steps of ``core-rl train`` on a tiny model through the plugin: prompts made by the
``reasoning_gym`` source (two tasks, 8 rows each), scored by the ``reasoning_gym`` reward: every
step logged with a reward in [0, 1] and every sample logged one of the source's rows."""

from __future__ import annotations

import json
import math
import os
import string
import sys
import time
from pathlib import Path

import yaml
from core_rl.testing import preloaded
from core_rl.testing.tiny import build_tiny_model
from core_rl_reasoning_gym.source import ReasoningGymSource, ReasoningGymSourceConfig

SOURCE = {
    "name": "reasoning_gym",
    "tasks": ["chain_sum", "basic_arithmetic"],
    "size": 8,
    "seed": 2,
    "task_options": {
        "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    },
}


def test_five_grpo_steps_on_a_tiny_model_through_the_source_and_the_reward(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", alphabet=string.ascii_letters + string.digits + " =+-*/?:>.,()\n")
    config = {
        "experiment": {"name": "rg", "output_dir": str(tmp_path / "runs"), "seed": 1},
        "data": {"sources": {"gym": SOURCE}, "train_files": ["source:gym"], "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-2}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 4, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "reasoning_gym", "answer_tag": ""},
        "trainer": {"total_steps": 5, "torch_threads": 1},
        "saver": {"export_hf": False},
        "loggers": [{"name": "jsonl"}],
        "sample_log": {"every_n_steps": 1, "num_samples": 8},
    }
    path = tmp_path / "rg.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = preloaded.run(
        [sys.executable, "-m", "core_rl.cli", "train", str(path)], capture_output=True, text=True, env=env, timeout=600
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "rg"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(s["reward/mean"]) and 0.0 <= s["reward/mean"] <= 1.0 for s in steps)
    rows = ReasoningGymSource(ReasoningGymSourceConfig(**{k: v for k, v in SOURCE.items() if k != "name"})).rows()
    prompts = {row["prompt"] for row in rows}
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 5 * 8 and all(s["prompt"] in prompts for s in samples)
    print(f"5 steps in {elapsed:.1f} s (process start to exit)")
