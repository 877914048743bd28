"""Five GRPO steps of ``core-rl train`` on a tiny model through the plugin, with verifiers in its
own venv: rows made by the ``verifiers`` data source from the multi-turn example taskset
(examples/tiny_guess.py), trajectories played by the ``verifiers`` environment (its ``Env``
answers higher/lower; the task's rewards score), every step logged with a reward in the range the
rewards allow. Also: core-rl's own environment is unchanged and cannot import verifiers, and a
taskset that does not exist stops the run with one line (exit 2)."""

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
from vf_options import options

GUESS = options("tiny-guess", taskset_options={"size": 8}, env_options={"max_guesses": 2})


def pip_freeze() -> str:
    return preloaded.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout


def train(tmp_path: Path, section: dict[str, Any], steps: int = 5, expect: int = 0) -> tuple[str, float]:
    """``core-rl train`` of GRPO on a tiny model with the ``verifiers`` environment of ``section``
    (output under ``tmp_path/runs/run``); its stderr and how long it took."""
    model = build_tiny_model(tmp_path / "model", alphabet=string.ascii_letters + string.digits + " =+-*/?:>.,()\n")
    workflow = {"name": "environment", "environment": {"name": "verifiers", **section}, "tool_timeout_s": 120}
    config = write_grpo_config(
        tmp_path,
        model,
        [],
        data={"sources": {"tasks": {"name": "verifiers", **section}}, "train_files": ["source:tasks"], "batch_size": 2},
        actor={"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-2}},
        rollout={
            "engine": {"name": "hf"},
            "sampling": {"n": 4, "max_new_tokens": 3},
            "workflow": {**workflow, "max_turns": 2, "max_tokens": 24},
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


def test_five_grpo_steps_through_the_multi_turn_env(tmp_path: Path) -> None:
    before = pip_freeze()
    _, elapsed = train(tmp_path, GUESS)
    run = tmp_path / "runs" / "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    # solved (0 or 1) + 0.5 x quick (1 / guesses) + 0.25 x digits (a share): at most 1.75
    assert all(math.isfinite(s["reward/mean"]) and 0.0 <= s["reward/mean"] <= 1.75 for s in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert any(s["info/turns"] == 2 and s["response"].count("higher") + s["response"].count("lower") for s in samples)
    assert all(set(s["info/steps"][-1]["rewards"]) == {"solved", "quick", "digits"} for s in samples)
    assert len(samples) == 5 * 8 and all(s["prompt"] == "Guess my digit:" for s in samples)
    assert pip_freeze() == before
    assert preloaded.run([sys.executable, "-c", "import verifiers"], capture_output=True).returncode != 0
    print(f"5 steps in {elapsed:.1f} s (process start to exit); rewards {[round(s['reward/mean'], 3) for s in steps]}")


def test_a_taskset_that_does_not_exist_is_one_line_and_exit_2(tmp_path: Path) -> None:
    stderr, _ = train(tmp_path, options("tiny-gues"), steps=1, expect=2)
    assert "Traceback" not in stderr
    assert "data.sources.<verifiers source>: data source 'verifiers' could not" in stderr
    assert "taskset 'tiny-gues' not found" in stderr
