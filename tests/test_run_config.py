"""``<run>/config.yaml`` (core_rl.loops.run_config): the resolved configuration is recorded and
loads back to the same configuration; a resume with changed settings keeps the earlier file and
names every changed key; a resume without changes keeps nothing extra."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_rl.builtin.loggers import read_metrics
from core_rl.config import load_config
from core_rl.config.loader import to_plain
from core_rl.config.schema import SchedulerConfig
from core_rl.loops.run_config import changed_keys
from core_rl.testing.faults import build_task, merged, run_dir
from core_rl_train_kit.optim import lr_at
from fault_helpers import train_here


def test_the_recorded_config_loads_back_to_the_run_configuration(tmp_path: Path, host) -> None:
    config = merged(build_task(tmp_path), trainer={"total_steps": 1, "torch_threads": 1})
    train_here(config, host)
    recorded = run_dir(config) / "config.yaml"
    ran = load_config(tmp_path / "run.yaml", host=host)  # the file train_here wrote
    again = load_config(recorded, host=host)
    assert to_plain(again) == to_plain(ran)
    assert to_plain(again)["rollout"]["engine"]["name"] == "hf"  # plugin sections with their defaults


def test_a_resume_with_changed_settings_keeps_the_earlier_config(tmp_path: Path, host, capsys) -> None:
    base = merged(build_task(tmp_path), trainer={"total_steps": 2, "torch_threads": 1})
    train_here(base, host)
    run = run_dir(base)
    capsys.readouterr()

    same = merged(base, trainer={"total_steps": 2, "torch_threads": 1, "resume": True})
    train_here(same, host)  # nothing left to train, nothing changed but how it resumes
    assert "setting(s) changed" not in capsys.readouterr().err
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.yaml"]
    before = (run / "config.yaml").read_text()

    lr = merged(
        base,
        actor={**base["actor"], "optimizer": {"name": "adamw", "lr": 5e-3}},
        trainer={"total_steps": 3, "torch_threads": 1},
        recover={"mode": "auto"},
    )
    train_here(lr, host)
    err = capsys.readouterr().err
    assert "resumed from step 2 with 2 setting(s) changed and 1 derived value(s) recomputed from them" in err, err
    for line in (
        "actor.optimizer.lr: 0.01 -> 0.005",
        "trainer.total_steps: 2 -> 3",
        "actor.lr_scheduler.total_steps: 2 -> 3",
    ):
        assert line in err, line
    assert (run / "config.step2.yaml").read_text() == before
    assert "lr: 0.005" in (run / "config.yaml").read_text()

    # from step 2 again, with another change: the file of the first resume is kept too
    from core_rl.checkpoint.store import roll_back

    roll_back(run, 2)
    second = (run / "config.yaml").read_text()
    train_here(merged(lr, actor={**base["actor"], "optimizer": {"name": "adamw", "lr": 2e-3}}), host)
    assert "actor.optimizer.lr: 0.005 -> 0.002" in capsys.readouterr().err
    assert (run / "config.step2.yaml").read_text() == before
    assert (run / "config.step2-2.yaml").read_text() == second


def test_extending_a_run_through_its_recorded_config_follows_the_new_horizon(tmp_path: Path, host, capsys) -> None:
    """A cosine run of 2 steps extended to 4 through its recorded file, as docs/runs.md says to
    (``core-rl train <run>/config.yaml recover.mode=resume trainer.total_steps=4``): the schedule's
    ``total_steps`` was recorded derived, so steps 3 and 4 train on the cosine over 4 steps (not at
    learning rate 0, the end of the cosine over 2), and the note names the recomputed value."""
    from core_rl import cli

    base = merged(build_task(tmp_path), trainer={"total_steps": 2, "torch_threads": 1})
    lr = base["actor"]["optimizer"]["lr"]
    config = merged(base, actor={**base["actor"], "lr_scheduler": {"name": "cosine"}})
    train_here(config, host)
    run = run_dir(config)
    recorded = (run / "config.yaml").read_text()
    assert "total_steps: 0  # derived: 2 = trainer.total_steps x" in recorded
    capsys.readouterr()

    assert cli.main(["train", str(run / "config.yaml"), "recover.mode=resume", "trainer.total_steps=4"]) == 0
    err = capsys.readouterr().err
    assert "resumed from step 2 with 1 setting(s) changed and 1 derived value(s) recomputed from them" in err, err
    assert "\n  trainer.total_steps: 2 -> 4\n" in err
    assert (
        "\n  actor.lr_scheduler.total_steps: 2 -> 4 (trainer.total_steps x algorithm.ppo_n_minibatches x "
        "algorithm.ppo_epochs = 4 x 1 x 1)"
    ) in err
    lrs = {row["step"]: row["actor/lr"] for row in read_metrics(run / "metrics.jsonl")}
    before, after = SchedulerConfig(name="cosine", total_steps=2), SchedulerConfig(name="cosine", total_steps=4)
    assert lrs[2] == pytest.approx(lr_at(1, lr, before))
    assert [lrs[3], lrs[4]] == pytest.approx([lr_at(2, lr, after), lr_at(3, lr, after)])
    assert lrs[4] > 0.1 * lr


@pytest.mark.parametrize(
    ("before", "after", "lines"),
    [
        ({"a": {"b": 1, "c": [1, 2]}}, {"a": {"b": 1, "c": [1, 2]}}, []),
        ({"a": {"b": 1}}, {"a": {"b": 2}}, ["a.b: 1 -> 2"]),
        ({"a": {"b": 1}}, {"a": {"b": 1, "d": "x"}}, ["a.d: (unset) -> 'x'"]),
        ({"a": [1]}, {"a": [1, 2]}, ["a: [1] -> [1, 2]"]),
        ({"a": {}}, {"a": {"k": None}}, ["a: {} -> (unset)", "a.k: (unset) -> None"]),
        ({"trainer": {"resume": False}, "recover": {"mode": "disabled"}}, {"trainer": {"resume": True}}, []),
    ],
)
def test_changed_keys(before: dict, after: dict, lines: list[str]) -> None:
    assert changed_keys(before, after) == lines


def test_the_recorded_config_exports_a_checkpoint_as_a_hf_model(tmp_path: Path, host) -> None:
    """docs/runs.md's recipe: ``core-rl train <run>/config.yaml recover.mode=resume
    saver.export_hf=true`` with ``trainer.total_steps`` at the newest checkpoint trains nothing and
    writes that checkpoint's weights as ``<run>/final_hf``."""
    import torch
    from core_rl import cli
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = merged(build_task(tmp_path), trainer={"total_steps": 2, "torch_threads": 1})
    train_here(config, host)
    run = run_dir(config)
    assert not (run / "final_hf").exists()
    overrides = ["recover.mode=resume", "saver.export_hf=true"]
    assert cli.main(["train", str(run / "config.yaml"), *overrides]) == 0
    model = AutoModelForCausalLM.from_pretrained(run / "final_hf")
    saved = load_file(run / "checkpoints" / "step_00000002" / "model.safetensors")
    exported = model.state_dict()
    assert saved.keys() <= exported.keys()
    assert all(torch.equal(saved[k], exported[k]) for k in saved)
    assert len(read_metrics(run / "metrics.jsonl")) == 2  # no step trained
