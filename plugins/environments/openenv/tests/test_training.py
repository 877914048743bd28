"""Five GRPO steps of ``core-rl train`` on a tiny model through the plugin, with OpenEnv in its own
venv: the example game (examples/digit_game.py) served locally by openenv-core's ``create_app``,
played over OpenEnv's client, rows from core-rl's ``function`` source (examples/digit_rows.py);
every step logged with a reward in the range the game pays. Also: core-rl's own environment is
unchanged and cannot import openenv, and an environment class that does not exist stops the run
with one line (exit 2)."""

from __future__ import annotations

import json
import math
import string
import sys
import time
from pathlib import Path
from typing import Any

from core_rl.testing import preloaded
from core_rl.testing.launch import run_train, write_grpo_config
from core_rl.testing.tiny import build_tiny_model
from openenv_game import EXAMPLES, GAME


def pip_freeze() -> str:
    return preloaded.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout


def train(tmp_path: Path, section: dict[str, Any], steps: int = 5, expect: int = 0) -> tuple[str, float]:
    """``core-rl train`` of GRPO on a tiny model with the ``openenv`` environment of ``section``
    (output under ``tmp_path/runs/run``); its stderr and how long it took."""
    model = build_tiny_model(tmp_path / "model", alphabet=string.ascii_letters + string.digits + " =+-*/?:>.,()\n")
    workflow = {"name": "environment", "environment": {"name": "openenv", **section}, "tool_timeout_s": 120}
    config = write_grpo_config(
        tmp_path,
        model,
        [],
        data={
            "sources": {"seeds": {"name": "function", "path": f"{EXAMPLES}/digit_rows.py:rows"}},
            "train_files": ["source:seeds"],
            "batch_size": 2,
        },
        actor={"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-2}},
        rollout={
            "engine": {"name": "hf"},
            "sampling": {"n": 4, "max_new_tokens": 2},
            "workflow": {**workflow, "max_turns": 3, "max_tokens": 40},
        },
        reward={"name": "workflow"},
        trainer={"total_steps": steps, "torch_threads": 1},
        saver={"export_hf": False},
        loggers=[{"name": "jsonl"}],
        sample_log={"every_n_steps": 1, "num_samples": 8},
    )
    started = time.monotonic()
    proc = run_train(config, expect=expect, timeout=900)
    return proc.stderr, time.monotonic() - started


def test_five_grpo_steps_through_an_openenv_server(tmp_path: Path) -> None:
    before = pip_freeze()
    _, elapsed = train(tmp_path, GAME)
    run = tmp_path / "runs" / "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    # at most two wrong digits (0.1 each) and a right one (1)
    assert all(math.isfinite(s["reward/mean"]) and 0.0 <= s["reward/mean"] <= 1.2 for s in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 5 * 8 and all(s["prompt"] == "Guess my digit (0-9):" for s in samples)
    # the game's answers are the observations between turns
    assert any(("higher" in s["response"] or "lower" in s["response"]) for s in samples)
    assert pip_freeze() == before
    assert preloaded.run([sys.executable, "-c", "import openenv"], capture_output=True).returncode != 0
    print(f"5 steps in {elapsed:.1f} s (process start to exit); rewards {[round(s['reward/mean'], 3) for s in steps]}")


def test_an_environment_class_that_does_not_exist_is_one_line_and_exit_2(tmp_path: Path) -> None:
    stderr, _ = train(tmp_path, {**GAME, "environment": "digit_game:NoSuchGame"}, steps=1, expect=2)
    assert "Traceback" not in stderr
    assert "rollout.workflow.environment: environment 'openenv' could not open" in stderr
    assert "NoSuchGame" in stderr
