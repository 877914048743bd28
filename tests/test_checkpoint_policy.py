"""``saver.every_n_minutes`` and ``saver.keep_best`` (:mod:`core_rl.checkpoint.policy`):
the ranking, the pruning that keeps the best, the clock, the configuration checks, and a two-rank
run that saves by time and keeps its best checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from core_rl.checkpoint import store as checkpoints
from core_rl.checkpoint.policy import SCORES_FILE, BestCheckpoints, TimedSaves
from core_rl.config.schema import KeepBestConfig


def _saved(run: Path, *steps: int) -> None:
    for step in steps:
        checkpoints.checkpoint_dir(run, step).mkdir(parents=True)
    checkpoints.mark_latest(run, steps[-1])


def test_scores_rank_by_mode_skip_what_a_step_did_not_log_and_persist(tmp_path: Path, capsys) -> None:
    best = BestCheckpoints(KeepBestConfig(count=2, metric="eval/reward"), tmp_path)
    for step, value in [(1, 0.5), (2, 0.9), (3, 0.7), (4, 0.9)]:
        assert best.record(step, {"eval/reward": value, "reward": 0.0}) == value
    assert best.record(5, {"reward": 1.0, "eval/rewards": 1.0}) is None  # no evaluation at that step
    assert "step 5 logged no 'eval/reward' (did you mean 'eval/rewards'?)" in capsys.readouterr().err
    assert best.record(6, {"eval/reward": math.nan}) is None and best.record(7, {"eval/reward": True}) is None
    assert best.ranked(range(1, 8)) == [(2, 0.9), (4, 0.9), (3, 0.7), (1, 0.5)]  # ties: the earlier step
    assert best.protected(range(1, 8)) == {2, 4} and best.protected([1, 3]) == {1, 3}

    again = BestCheckpoints(KeepBestConfig(count=1, metric="eval/reward", mode="min"), tmp_path)
    assert again.protected(range(1, 8)) == {1}  # read back from scores.json, the smallest first
    other = BestCheckpoints(KeepBestConfig(count=1, metric="eval/pass@1"), tmp_path)
    assert other.scores == {}  # scores of another metric are not this one's
    assert json.loads((tmp_path / "checkpoints" / SCORES_FILE).read_text())["metric"] == "eval/reward"


def test_pruning_keeps_the_newest_and_the_best(tmp_path: Path) -> None:
    _saved(tmp_path, 1, 2, 3, 4, 5, 6)
    best = BestCheckpoints(KeepBestConfig(count=1, metric="reward"), tmp_path)
    for step, value in [(2, 0.9), (3, 0.1), (5, 0.2), (6, 0.3)]:
        best.record(step, {"reward": value})
    checkpoints.prune(tmp_path, keep_last=2, keep=best.protected)
    assert [s for s, _ in checkpoints.list_checkpoints(tmp_path)] == [2, 5, 6]
    checkpoints.prune(tmp_path, keep_last=2)  # without keep_best: the newest two
    assert [s for s, _ in checkpoints.list_checkpoints(tmp_path)] == [5, 6]
    assert best.best_line(tmp_path) == (
        f"best:       {checkpoints.checkpoint_dir(tmp_path, 6)} (reward 0.3, saver.keep_best)"
    )  # the best that still exists


def test_timed_saves_follow_the_clock_from_the_last_save() -> None:
    now = [100.0]
    timed = TimedSaves(0.5, clock=lambda: now[0])
    now[0] += 29.0
    assert not timed.due()
    now[0] += 1.0
    assert timed.due()
    timed.saved()
    assert not timed.due()
    assert not TimedSaves(0.0, clock=lambda: now[0] + 1e9).due()  # 0: off


pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

from core_rl.testing import preloaded  # noqa: E402
from core_rl.testing.launch import cpu_ranks_env  # noqa: E402
from fault_helpers import build_task, cli_command, cli_env, write_config  # noqa: E402


def test_an_evaluation_metric_needs_evaluations_on_the_checkpoint_steps(tmp_path: Path) -> None:
    config = build_task(tmp_path)
    config["saver"] = {**config["saver"], "every_n_steps": 2, "keep_best": {"count": 1}}
    path = write_config(config, tmp_path / "run.yaml")
    out = preloaded.run(cli_command("config", "validate", str(path)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert (
        "saver.keep_best.metric: 'eval/reward/mean' is an evaluation metric, and the run has no eval: section"
        in out.stderr
    )
    evals = f"eval={{files: [{config['data']['train_files'][0]}], every_n_steps: 3}}"
    out = preloaded.run(
        cli_command("config", "validate", str(path), evals), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "make saver.every_n_steps a multiple of eval.every_n_steps" in out.stderr, out.stderr


def test_two_ranks_save_by_time_and_keep_the_best_checkpoint(tmp_path: Path) -> None:
    """A checkpoint after every step by time alone (rank 0's clock, followed by rank 1), then only
    the newest and the one with the best mean reward are kept."""
    config = build_task(tmp_path)
    config["saver"] = {
        "every_n_steps": 0,
        "every_n_minutes": 1e-4,  # 6 ms: every step takes longer
        "keep_last": 1,
        "keep_best": {"count": 1, "metric": "reward/mean"},
        "export_hf": False,
        "at_end": False,
    }
    path = write_config(config, tmp_path / "run.yaml")
    scratch = tmp_path / "tmp"  # the launch's temporary files: none is left behind
    scratch.mkdir()
    out = preloaded.run(
        cli_command("train", "--nproc-per-node", "2", str(path)),
        capture_output=True,
        text=True,
        timeout=600,
        env=cpu_ranks_env({**cli_env(), "TMPDIR": str(scratch)}),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in scratch.iterdir()) == []
    run = tmp_path / "runs" / "run"
    rewards = {json.loads(line)["step"]: json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").open()}
    scores = json.loads((run / "checkpoints" / SCORES_FILE).read_text())["scores"]
    assert {int(s): v for s, v in scores.items()} == pytest.approx(rewards)  # every step was saved and scored
    best = min(rewards, key=lambda s: (-rewards[s], s))
    assert [s for s, _ in checkpoints.list_checkpoints(run)] == sorted({best, 4})
    assert f"best:       {checkpoints.checkpoint_dir(run, best)} (reward/mean " in out.stdout
