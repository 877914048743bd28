"""``core-rl checkpoints`` (core_rl.checkpoint.store.roll_back): listing a run's checkpoints,
and rolling a run back to an earlier one without deleting anything, after which resuming
reproduces the abandoned steps bit for bit (runs are deterministic for a seed)."""

from __future__ import annotations

from pathlib import Path

from core_rl import cli
from core_rl.builtin.loggers import read_metrics
from core_rl.testing.faults import build_task, checkpoint, merged, run_dir, stable_metrics, state_digest
from fault_helpers import train_here


def test_roll_back_then_resume_repeats_the_later_steps_exactly(tmp_path: Path, host, capsys) -> None:
    config = merged(build_task(tmp_path), trainer={"total_steps": 4, "torch_threads": 1})
    train_here(config, host)
    run = run_dir(config)
    first = stable_metrics(run)
    capsys.readouterr()
    assert cli.main(["checkpoints", str(run)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert len(listing) == 4 and listing[-1].endswith("step_00000004  (latest)")

    assert cli.main(["checkpoints", str(run), "--roll-back-to", "2"]) == 0
    out = capsys.readouterr().out
    aside = run / "checkpoints" / "rolled_back_from_4"
    assert f"to {aside}" in out and "recover.mode=auto" in out
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_00000003", "step_00000004"]
    assert [r["step"] for r in read_metrics(aside / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
    assert not checkpoint(run, 3).exists()

    train_here(merged(config, recover={"mode": "auto"}), host)  # continues from step 2
    assert stable_metrics(run) == first
    assert state_digest(checkpoint(run, 4)) == state_digest(aside / "step_00000004")
    capsys.readouterr()

    assert cli.main(["checkpoints", str(run), "--roll-back-to", "3"]) == 2  # rolled_back_from_4 exists
    assert "exists already" in capsys.readouterr().err
    assert cli.main(["checkpoints", str(run)]) == 0
    assert f"set aside by a roll-back: {aside} (steps 3, 4)" in capsys.readouterr().out


def test_roll_back_to_a_step_without_a_checkpoint_names_the_ones_there(tmp_path: Path, host, capsys) -> None:
    config = merged(
        build_task(tmp_path),
        trainer={"total_steps": 4, "torch_threads": 1},
        saver={"every_n_steps": 2, "keep_last": 10, "export_hf": False},
    )
    train_here(config, host)
    run = run_dir(config)
    capsys.readouterr()
    assert cli.main(["checkpoints", str(run), "--roll-back-to", "3"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 3" in err and "checkpoints of steps: 2, 4" in err and "Traceback" not in err
    assert (run / "checkpoints" / "latest").read_text() == "step_00000004"  # nothing changed
    assert cli.main(["checkpoints", str(tmp_path)]) == 2
    assert "no checkpoints/ here" in capsys.readouterr().err
