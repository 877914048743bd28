"""What checkpoints hold of the optimizer and what a resume loads, in real runs (fsdp + hf engines,
grpo, in this process): ``saver.save_optimizer: false`` writes checkpoints without optimizer
state, which a resume refuses unless ``recover.load_optimizer: false``; with it the run goes on
from the same weights, data position and RNG (step 4 logs what the uninterrupted run logged) with
a fresh optimizer (the weights after step 4 differ). ``algorithm.reference_reset_optimizer`` drops
the actor's optimizer state at each reference reset (the checkpoint of a reset step holds none),
and is refused without reference resets or with an engine that cannot reset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from core_rl import cli
from core_rl.checkpoint import store as checkpoints
from core_rl.testing.faults import build_task, checkpoint, merged, run_dir, stable_metrics, state_digest

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


def _write(config: dict, tmp_path: Path) -> Path:
    path = tmp_path / f"{config['experiment']['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _meta(run: Path, step: int) -> dict:
    return json.loads((checkpoint(run, step) / "meta.json").read_text())


def test_checkpoints_without_optimizer_resume_only_with_a_fresh_one(tmp_path: Path, capsys) -> None:
    lean = merged(build_task(tmp_path), experiment={"name": "lean"}, saver={"save_optimizer": False})
    assert cli.main(["train", str(_write(lean, tmp_path))]) == 0
    straight = run_dir(lean)
    for step in range(1, 5):
        assert _meta(straight, step)["optimizer_state"] == "left_out"
        assert not list(checkpoint(straight, step).glob("optimizer*"))
    # the run as if it had stopped after step 3
    resumed = merged(lean, experiment={"name": "resumed"}, recover={"mode": "resume"})
    shutil.copytree(straight, run_dir(resumed))
    checkpoints.roll_back(run_dir(resumed), 3)
    path = _write(resumed, tmp_path)
    capsys.readouterr()
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "saved without its optimizer state (saver.save_optimizer: false); set recover.load_optimizer: false" in err
    assert cli.main(["train", str(path), "recover.load_optimizer=false"]) == 0
    err = capsys.readouterr().err
    assert err.count("recover.load_optimizer is false") == 1, err
    # step 4 ran on the weights, data and RNG of step 3 (what it logs comes before its update) ...
    assert stable_metrics(run_dir(resumed)) == stable_metrics(straight)
    # ... and updated them with a fresh optimizer, not the one the straight run had built up
    digest = state_digest(checkpoint(straight, 4))["model.safetensors"]
    assert state_digest(checkpoint(run_dir(resumed), 4))["model.safetensors"] != digest


def test_reference_reset_optimizer_drops_the_actor_state_at_each_reset(tmp_path: Path) -> None:
    config = merged(
        build_task(tmp_path),
        experiment={"name": "prorl"},
        algorithm={
            "name": "grpo",
            "loss": {"name": "ppo_clip", "kl_coef": 0.5},
            "reference_reset_every_n_steps": 2,
            "reference_reset_optimizer": True,
        },
        trainer={"total_steps": 3},
    )
    assert cli.main(["train", str(_write(config, tmp_path))]) == 0
    states = {step: _meta(run_dir(config), step)["optimizer_state"] for step in (1, 2, 3)}
    assert states == {1: "saved", 2: "none_yet", 3: "saved"}


def test_reference_reset_optimizer_needs_resets(tmp_path: Path, capsys) -> None:
    config = merged(build_task(tmp_path), algorithm={"name": "grpo", "reference_reset_optimizer": True})
    assert cli.main(["config", "validate", str(_write(config, tmp_path))]) == 2
    assert (
        "algorithm.reference_reset_optimizer: drops the actor's optimizer state at each reference reset, and "
        "algorithm.reference_reset_every_n_steps is 0" in capsys.readouterr().err
    )


def test_restarts_from_checkpoints_without_optimizer_need_load_optimizer_false(tmp_path: Path, capsys) -> None:
    config = merged(build_task(tmp_path), saver={"save_optimizer": False}, recover={"mode": "auto"})
    path = _write(config, tmp_path)
    assert cli.main(["config", "validate", str(path)]) == 2
    assert "recover.retries: 3), which recover.load_optimizer: true refuses; set recover.load_optimizer: false" in (
        capsys.readouterr().err
    )
    for fix in ("recover.load_optimizer=false", "recover.retries=0", "recover.mode=resume"):
        assert cli.main(["config", "validate", str(path), fix]) == 0, fix


def test_reference_reset_optimizer_needs_an_engine_that_resets(tmp_path: Path) -> None:
    from core_rl.config.schema import AlgorithmConfig, RunConfig
    from core_rl.errors import ConfigError
    from core_rl.loops.rl.reference_reset import ReferenceReset

    cfg = RunConfig(algorithm=AlgorithmConfig(reference_reset_every_n_steps=2, reference_reset_optimizer=True))
    with pytest.raises(ConfigError, match="algorithm.reference_reset_optimizer: the actor's engine 'fsdp' cannot"):
        ReferenceReset.of_run(cfg, None, None, True, actor=object())  # type: ignore[arg-type]
