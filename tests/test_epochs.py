"""``trainer.total_epochs`` (core_rl.config.epochs): the run's steps derived from the prompts left
after filtering, the schedules and checks that follow the derived count, the conflict with
``trainer.total_steps``, and real ``core-rl train`` runs that stop after exactly the derived number
of steps, resume to the same count, and follow the data when it grows."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_rl.config import load_config
from core_rl.config.epochs import derive_total_steps, epoch_steps
from core_rl.config.loader import to_yaml
from core_rl.errors import ConfigError
from core_rl.testing import preloaded
from core_rl.testing.faults import build_task, merged, run_dir, same_run
from fault_helpers import cli_command, cli_env, cli_train

#: six prompts, the last longer than max_prompt_tokens=8 (dropped by data.filter_overlong_prompts)
PROMPTS = ("ab", "ba", "abc", "dca", "bd", "abcdabcdabcdabcd")


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("epochs", "prompts", "batch", "steps"),
    [
        (3, 100, 8, 38),  # 300 draws / 8 = 37.5: the 38th step ends pass 3 and takes 4 of pass 4
        (1, 5, 2, 3),  # a partial last batch: 2 + 2 + 1, filled with 1 prompt of the next pass
        (3, 5, 2, 8),  # 15 draws: 7 full batches and one more
        (2, 6, 2, 6),  # a batch size dividing the data: 3 steps per epoch exactly
        (1, 1, 8, 1),  # fewer prompts than a batch: one step draws the prompt 8 times
    ],
)
def test_epoch_steps_by_hand(epochs: int, prompts: int, batch: int, steps: int) -> None:
    assert epoch_steps(epochs, prompts, batch) == steps


def test_total_steps_and_schedules_wait_for_the_data_then_follow_it(tmp_path, host, minimal_config, capsys) -> None:
    minimal_config["trainer"] = {"total_epochs": 3}
    minimal_config["data"]["batch_size"] = 8
    minimal_config["actor"]["lr_scheduler"] = {"name": "cosine", "warmup_ratio": 0.1}
    cfg = load_config(_write(tmp_path, minimal_config), ["algorithm.ppo_epochs=2"], host=host)
    assert cfg.trainer.total_steps == 0 and cfg.actor.lr_scheduler.total_steps == 0
    shown = to_yaml(cfg)
    assert (
        "  total_steps: 0  # derived: ceil(trainer.total_epochs x prompts / data.batch_size), when the run starts\n"
        in (shown)
    )

    assert derive_total_steps(cfg, 100) == 38
    assert "core-rl: trainer.total_steps: 38 = ceil(3 epoch(s) x 100 prompts / 8 per step)" in capsys.readouterr().err
    # the schedules follow the derived count: 38 steps x 2 optimiser steps, 10% of them warm-up
    assert (cfg.actor.lr_scheduler.total_steps, cfg.actor.lr_scheduler.warmup_steps) == (76, 7)
    recorded = to_yaml(cfg)
    assert (
        "  total_steps: 0  # derived: 38 = ceil(trainer.total_epochs x prompts / data.batch_size) = ceil(3 x 100 / 8)\n"
    ) in recorded
    assert "    total_steps: 0  # derived: 76 = trainer.total_steps x algorithm.ppo_n_minibatches x " in recorded
    assert "    warmup_steps: 0  # derived: 7 = floor(warmup_ratio x total_steps) = floor(0.1 x 76)\n" in recorded

    # the recorded file loads to a run that derives again, from the data it then has
    (tmp_path / "recorded.yaml").write_text(recorded)
    again = load_config(tmp_path / "recorded.yaml", host=host)
    assert again.trainer.total_steps == 0
    assert derive_total_steps(again, 120) == 45 and again.actor.lr_scheduler.total_steps == 90


def test_checks_of_the_step_count_run_on_the_derived_count(tmp_path, host, minimal_config) -> None:
    minimal_config["trainer"] = {"total_epochs": 2, "profile": {"steps": [3, 4]}}
    minimal_config["data"]["batch_size"] = 4
    minimal_config["actor"]["lr_scheduler"] = {"name": "linear", "total_steps": 2}
    cfg = load_config(_write(tmp_path, minimal_config), host=host)  # nothing to check yet
    with pytest.raises(ConfigError) as caught:
        derive_total_steps(cfg, 6)  # ceil(2 x 6 / 4) = 3 steps
    assert caught.value.problems == [
        "actor.lr_scheduler.total_steps: the linear schedule reaches learning rate 0 at optimiser step 2, but the run "
        "takes 3 (trainer.total_steps=3 derived from trainer.total_epochs=2 x 1 optimiser step(s) per step), so its "
        "last 1 optimiser steps would not train; set actor.lr_scheduler.total_steps=0 (the default: follow "
        "trainer.total_steps) or at least 3, or actor.lr_scheduler.min_lr_ratio above 0",
        "trainer.profile.steps: [4] is after the last step (trainer.total_steps=3 derived from "
        "trainer.total_epochs=2); list steps from 1 to 3",
    ]


def test_total_steps_with_total_epochs_is_one_error_from_the_cli(tmp_path, minimal_config) -> None:
    """Exit 2 and one line naming both keys; ``total_steps: 0`` (the recorded form) is fine with
    total_epochs and still refused without it."""
    del minimal_config["loggers"]
    minimal_config.update(
        actor={"model_path": "/m"}, rollout={}, algorithm={"name": "grpo"}, reward={"name": "exact_match"}
    )
    path = _write(tmp_path, {**minimal_config, "trainer": {"total_epochs": 3, "total_steps": 50}})
    proc = preloaded.run(cli_command("config", "validate", str(path)), capture_output=True, text=True, env=cli_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    problems = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert problems == [
        "  - trainer.total_epochs: 3 is set together with trainer.total_steps (50); the run's length is one of them: "
        "remove trainer.total_steps (override ~trainer.total_steps) to train 3 epoch(s), or remove "
        "trainer.total_epochs to train 50 steps"
    ]
    ok = preloaded.run(
        cli_command("config", "validate", str(path), "trainer.total_steps=0"),
        capture_output=True,
        text=True,
        env=cli_env(),
    )
    assert ok.returncode == 0, ok.stderr
    zero = preloaded.run(
        cli_command("config", "validate", str(path), "~trainer.total_epochs", "trainer.total_steps=0"),
        capture_output=True,
        text=True,
        env=cli_env(),
    )
    assert zero.returncode == 2 and "trainer.total_steps: must be in [1, 1000000000], got 0" in zero.stderr


# -- real runs -------------------------------------------------------------------------------------


def _epoch_task(root: Path, epochs: int, prompts: tuple[str, ...] = PROMPTS) -> dict[str, Any]:
    """The tiny task with ``epochs`` epochs, 2 prompts per step, the long prompt filtered out, every
    sample of every step in samples.jsonl."""
    base = build_task(root, prompts=prompts)
    trainer = {"total_epochs": epochs, "torch_threads": 1}
    data = {**base["data"], "filter_overlong_prompts": True, "max_prompt_tokens": 8}
    config = merged(base, data=data, loggers=[{"name": "jsonl"}], sample_log={"every_n_steps": 1, "num_samples": 8})
    config["trainer"] = trainer
    return config


def _draws(run: Path) -> Counter[str]:
    """Prompt -> how many times the run drew it (samples.jsonl holds its 4 samples per draw)."""
    samples = Counter(json.loads(line)["prompt"] for line in (run / "samples.jsonl").read_text().splitlines())
    assert all(count % 4 == 0 for count in samples.values()), samples
    return Counter({prompt: count // 4 for prompt, count in samples.items()})


def _train(config: dict[str, Any], *overrides: str) -> subprocess.CompletedProcess[str]:
    proc = cli_train(config, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_run_of_three_epochs_stops_after_the_derived_steps(tmp_path: Path) -> None:
    """5 prompts left of 6, 2 per step: ceil(3 x 5 / 2) = 8 steps; every prompt drawn 3 times, one
    of them a 4th time to fill the last batch."""
    config = _epoch_task(tmp_path, 3)
    proc = _train(config)
    run = run_dir(config)
    assert "dropped 1 of 6 prompts longer than data.max_prompt_tokens=8" in proc.stderr
    assert "core-rl: trainer.total_steps: 8 = ceil(3 epoch(s) x 5 prompts / 2 per step) (2.5 steps per epoch" in (
        proc.stderr
    )
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    drawn = _draws(run)
    assert sorted(drawn.values()) == [3, 3, 3, 3, 4] and "abcdabcdabcdabcd=" not in drawn
    recorded = (run / "config.yaml").read_text()
    assert (
        "  total_steps: 0  # derived: 8 = ceil(trainer.total_epochs x prompts / data.batch_size) = ceil(3 x 5 / 2)\n"
        in (recorded)
    )
    assert "    total_steps: 0  # derived: 8 = trainer.total_steps x " in recorded  # the actor's schedule


def test_a_resumed_epoch_run_matches_the_uninterrupted_one(tmp_path: Path) -> None:
    """One epoch (3 steps), then resumed to two (ceil(2 x 5 / 2) = 5 steps): bitwise the run that
    trained two epochs at once. Resumed again with nothing changed, it derives 5 again, trains
    nothing and reports no change."""
    whole = _epoch_task(tmp_path / "whole", 2)
    _train(whole)
    part = _epoch_task(tmp_path / "part", 1)
    _train(part)
    assert len((run_dir(part) / "metrics.jsonl").read_text().splitlines()) == 3
    _train(part, "trainer.total_epochs=2", "recover.mode=resume")
    assert same_run(run_dir(whole), run_dir(part), 5)
    again = _train(part, "trainer.total_epochs=2", "recover.mode=resume")
    assert "trainer.total_steps: 5 = ceil(2 epoch(s) x 5 prompts / 2 per step)" in again.stderr
    assert "setting(s) changed" not in again.stderr and "recomputed" not in again.stderr
    assert len((run_dir(part) / "metrics.jsonl").read_text().splitlines()) == 5


def test_a_run_resumed_over_more_data_runs_to_its_new_count(tmp_path: Path) -> None:
    """Resumed with 4 more prompts (9), one epoch is ceil(9 / 2) = 5 steps: the run continues from
    step 3 to 5. Resumed with fewer than its checkpoint's step needs, it is refused naming
    trainer.total_epochs."""
    config = _epoch_task(tmp_path, 1)
    _train(config)
    data = Path(config["data"]["train_files"][0])
    more = "".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in ("cd", "dc", "ad", "da"))
    data.write_text(data.read_text() + more)
    proc = _train(config, "recover.mode=resume")
    assert "trainer.total_steps: 5 = ceil(1 epoch(s) x 9 prompts / 2 per step)" in proc.stderr
    steps = [json.loads(line)["step"] for line in (run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]

    data.write_text("".join(data.read_text().splitlines(keepends=True)[:2]))  # 2 prompts: 1 step
    short = cli_train(config, "recover.mode=resume")
    assert short.returncode == 2 and "Traceback" not in short.stderr
    assert "trainer.total_steps=1 (derived from trainer.total_epochs=1 and the data) is below the step of the" in (
        short.stderr
    )
    assert "raise trainer.total_epochs to continue this run" in short.stderr
