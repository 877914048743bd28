"""``algorithm.reference_reset_every_n_steps`` (:mod:`core_rl.loops.rl.reference_reset`): with a KL
penalty, the reference becomes the policy every ``k`` steps (the KL the loss sees is 0 right after a
reset, as the policy it starts from is the reference; not without resets), the exports no kept
checkpoint needs are removed, a resumed run takes the reference of its reset step and ends exactly
as an uninterrupted one, and a run without a reference model refuses the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.checkpoint.hf_exports import exported_steps
from core_rl.loops.rl.reference_reset import reset_step

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


def test_the_reset_step_of_each_step() -> None:
    assert [reset_step(s, 3) for s in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert reset_step(5, 0) == 0


def test_an_old_kept_checkpoint_pins_its_own_reference_and_no_other(tmp_path: Path) -> None:
    """saver.keep_best may keep the checkpoint of step 2 beside those of steps 7 and 8: the exports
    of their reset steps (2, 6) and the newest (8) stay, the one between (4) goes."""
    from core_rl.checkpoint import store as checkpoints
    from core_rl.config.schema import ActorConfig
    from core_rl.loops.rl.reference_reset import ReferenceReset, reference_dir

    for step in (2, 4, 6, 8):
        reference_dir(tmp_path, step).mkdir(parents=True)
    for step in (2, 7, 8):
        checkpoints.checkpoint_dir(tmp_path, step).mkdir(parents=True)
    reset = ReferenceReset(2, ActorConfig(), tmp_path, lambda section: None, True)
    assert reset.prune(tmp_path) == [4]
    assert exported_steps(tmp_path, "reference") == [2, 6, 8]


def _write(tmp_path: Path, name: str, **sections) -> Path:
    from core_rl.testing.faults import build_task, merged

    base = build_task(tmp_path)
    config = merged(
        base,
        experiment={"name": name},
        algorithm={"name": "grpo", "loss": {"name": "ppo_clip", "kl_coef": 0.5}, **sections.pop("algorithm", {})},
        trainer={"total_steps": 6},
        saver={"every_n_steps": 1, "keep_last": 2},
        loggers=[{"name": "jsonl"}],
        **sections,
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_reference_follows_the_policy_and_a_resumed_run_agrees(tmp_path: Path) -> None:
    from core_rl import cli
    from core_rl.testing.faults import same_run

    runs = tmp_path / "runs"
    reset = _write(tmp_path, "reset", algorithm={"reference_reset_every_n_steps": 2})
    assert cli.main(["train", str(reset)]) == 0
    kl = {r["step"]: r["actor/kl"] for r in read_metrics(runs / "reset" / "metrics.jsonl")}
    # steps 3 and 5 start from the policy the reference was just reset to (steps 2 and 4)
    assert kl[3] < 1e-6 and kl[5] < 1e-6 and kl[4] > 1e-4 and kl[6] > 1e-4, kl
    # checkpoints 5 and 6 are kept: they need the references of steps 4 and 6
    assert exported_steps(runs / "reset", "reference") == [4, 6]
    plain = _write(tmp_path, "plain")
    assert cli.main(["train", str(plain)]) == 0
    assert read_metrics(runs / "plain" / "metrics.jsonl")[2]["actor/kl"] > 1e-4  # step 3, no reset
    # three steps, then three more from the checkpoint of step 3: the reference of step 2 is rebuilt
    assert cli.main(["train", str(reset), "experiment.name=resumed", "trainer.total_steps=3"]) == 0
    assert cli.main(["train", str(reset), "experiment.name=resumed", "recover.mode=auto"]) == 0
    assert same_run(runs / "reset", runs / "resumed", 6)
    # without periodic checkpoints only the newest reference is kept
    assert (
        cli.main(["train", str(reset), "experiment.name=unsaved", "saver.every_n_steps=0", "saver.at_end=false"]) == 0
    )
    assert exported_steps(runs / "unsaved", "reference") == [6]


def test_a_run_without_a_reference_refuses_resets(tmp_path: Path, capsys) -> None:
    from core_rl import cli

    path = _write(tmp_path, "none", algorithm={"loss": {"name": "ppo_clip"}, "reference_reset_every_n_steps": 2})
    assert cli.main(["train", str(path)]) == 2
    assert "algorithm.reference_reset_every_n_steps: the run has no reference model" in capsys.readouterr().err


def test_a_loop_that_does_not_reset_its_reference_refuses_the_setting(tmp_path: Path, capsys) -> None:
    from core_rl import cli

    path = _write(tmp_path, "sft", algorithm={"name": "sft", "reference_reset_every_n_steps": 2})
    assert cli.main(["config", "validate", str(path)]) == 2
    assert "algorithm.reference_reset_every_n_steps: the 'sft' loop does not reset" in capsys.readouterr().err
