"""The train/rollout mismatch on real ``core-rl train`` runs (fsdp, hf, grpo, char_match, a tiny
model): its metrics in every step of a plain GRPO run, measured without a recompute as with one,
and ``algorithm.mismatch_budget``'s three actions on a mismatch forced by
``CORE_RL_TEST_BEHAVE_NOISE`` (:mod:`core_rl.loops.rl.behave_noise`)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.loops.rl.behave_noise import NOISE_VARIABLE
from core_rl.testing.launch import run_train
from core_rl.testing.tiny import build_tiny_model

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

MISMATCH = ("mismatch/abs_logprob_diff", "mismatch/kl_behave_trainer", "mismatch/ratio_out_of_bounds")
#: the noise forced on the behaviour log-probs, and the mean |noise| it gives: STD * sqrt(2 / pi)
STD = 0.5
EXPECTED_ABS = STD * math.sqrt(2 / math.pi)
REWARDS = Path(__file__).with_name("reward_functions.py")


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mismatch")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "train.jsonl"
    rows = ("ab", "ba", "abc", "dca", "bd", "cc")
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in rows))
    cfg = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 3},
        "data": {"train_files": [str(data)], "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-2}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 4, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo", "loss": {"name": "ppo_clip"}},
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": 3, "torch_threads": 1},
        "saver": {"every_n_steps": 1, "keep_last": 5, "at_end": False},
        "loggers": [{"name": "console"}],
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run_dir(config: Path, name: str) -> Path:
    return config.parent / "runs" / name


def _budget(**keys: object) -> list[str]:
    return [f"algorithm.mismatch_budget.{k}={v}" for k, v in keys.items()]


def test_plain_grpo_logs_the_mismatch_every_step(config):
    """On-policy GRPO recomputes nothing: the first optimiser step measures the mismatch. The hf
    engine samples with the trainer's weights in fp32, so the mismatch is near 0."""
    run_train(config, "experiment.name=plain")
    rows = read_metrics(_run_dir(config, "plain") / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert set(MISMATCH) <= set(row), row
        assert "timing/mismatch_s" in row
        assert 0.0 <= row["mismatch/abs_logprob_diff"] < 1e-3
        assert 0.0 <= row["mismatch/kl_behave_trainer"] < 1e-5
        assert row["mismatch/ratio_out_of_bounds"] == 0.0
        assert "mismatch/over_budget" not in row  # no threshold: metrics only


@pytest.fixture(scope="module")
def warned(config: Path) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """One run with noise on the behaviour log-probs and ``action: warn`` over a threshold of 0.1
    with a patience of 2 (a warning changes nothing of the run): its process and metrics, for the
    warning's test and, as the run that measures without a recompute, the first step's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NOISE_VARIABLE, str(STD))
        proc = run_train(config, "experiment.name=warn", *_budget(threshold=0.1, action="warn", patience=2))
    return proc, read_metrics(_run_dir(config, "warn") / "metrics.jsonl")


def test_first_step_measure_equals_a_recompute(config, warned, monkeypatch):
    """With noise on the behaviour log-probs, the mismatch measured in the first optimiser step
    (no recompute; the ``warned`` run) is the one a recompute of ``old_logprobs`` gives, on the same
    samples (step 1: the same seed and weights), and its size is the noise's."""
    monkeypatch.setenv(NOISE_VARIABLE, str(STD))
    run_train(config, "experiment.name=recompute", "algorithm.recompute_logprob=true")
    probe = warned[1][0]
    recompute = read_metrics(_run_dir(config, "recompute") / "metrics.jsonl")[0]
    assert "offpolicy/kl_behave_old" in recompute and "offpolicy/kl_behave_old" not in probe
    assert recompute["offpolicy/kl_behave_old"] == pytest.approx(recompute["mismatch/kl_behave_trainer"])
    for key in MISMATCH:
        assert probe[key] == pytest.approx(recompute[key], rel=1e-4, abs=1e-6), key
    assert probe["mismatch/abs_logprob_diff"] == pytest.approx(EXPECTED_ABS, rel=0.35)
    assert probe["mismatch/ratio_out_of_bounds"] > 0.0  # |noise| > log 2 on about 17% of tokens


def test_a_zero_signal_step_is_measured_by_a_forward_pass(config, monkeypatch):
    """Every reward alike (a constant): every first optimiser step is zero-signal and skips its
    forward pass; the probe's own forward pass measures what a recompute does."""
    monkeypatch.setenv(NOISE_VARIABLE, str(STD))
    constant = [
        "reward.name=function",
        f"reward.path={REWARDS}:scaled_length",
        'reward.kwargs={"scale": 0.0, "offset": 1.0}',
    ]
    run_train(config, "experiment.name=zero", *constant)
    run_train(config, "experiment.name=zero_recompute", "algorithm.recompute_logprob=true", *constant)
    zero = read_metrics(_run_dir(config, "zero") / "metrics.jsonl")
    recompute = read_metrics(_run_dir(config, "zero_recompute") / "metrics.jsonl")
    assert all(r["actor/zero_signal_update"] == 1.0 for r in zero)
    for probe, recomputed in zip(zero, recompute):
        for key in MISMATCH:
            assert probe[key] == pytest.approx(recomputed[key], rel=1e-4, abs=1e-6), key
        assert probe["timing/mismatch_s"] > 0.0


def test_warn_names_the_metric_value_and_threshold_after_patience(warned):
    proc, rows = warned
    lines = [line for line in proc.stderr.splitlines() if "mismatch over budget" in line]
    # steps 1, 2 over budget: the warning at step 2; step 3 starts a new streak of 1
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "mismatch/abs_logprob_diff = " in lines[0] and "threshold 0.1 at step 2 for 2 steps" in lines[0]
    assert [r["mismatch/over_budget"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r["mismatch/over_budget_total"] for r in rows] == [1.0, 2.0, 3.0]


def test_stop_ends_the_run_with_one_line_and_saves_nothing_of_that_step(config, monkeypatch):
    monkeypatch.setenv(NOISE_VARIABLE, str(STD))
    proc = run_train(config, "experiment.name=stop", *_budget(threshold=0.1, action="stop", patience=2), expect=1)
    assert "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if "mismatch over budget" in line]
    assert "mismatch/abs_logprob_diff = " in line and "threshold 0.1 at step 2" in line and "action: stop" in line
    run = _run_dir(config, "stop")
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]  # the stopping step is logged
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert saved == ["step_00000001"]  # step 2's checkpoint (due every step) is not written


def test_correct_turns_on_truncated_importance_sampling_from_the_next_step(config, monkeypatch):
    monkeypatch.setenv(NOISE_VARIABLE, str(STD))
    proc = run_train(
        config,
        "experiment.name=correct",
        "algorithm.loss.use_decoupled_loss=true",
        *_budget(threshold=0.1, action="correct", patience=1),
    )
    [line] = [line for line in proc.stderr.splitlines() if "mismatch over budget" in line]
    assert "at step 1" in line and "turning on the importance-sampling correction 'tis'" in line
    assert "from step 2 on" in line
    rows = read_metrics(_run_dir(config, "correct") / "metrics.jsonl")
    assert [r["mismatch/correction_on"] for r in rows] == [0.0, 1.0, 1.0]
    # step 1: the decoupled loss's behaviour weight pi_prox / pi_behave untruncated (noise of std
    # 0.5 takes some above 2); from step 2 truncated at tis's default upper bound 2, and reported
    assert "actor/clamped" not in rows[0]
    assert rows[0]["actor/behave_weight_max"] == pytest.approx(rows[0]["offpolicy/behave_ratio_max"], rel=1e-5)
    assert rows[0]["actor/behave_weight_max"] > 2.0
    for row in rows[1:]:
        assert row["actor/behave_weight_max"] <= 2.0 + 1e-6
        assert (row["actor/clamped"] > 0.0) == (row["offpolicy/behave_ratio_max"] > 2.0)
    assert any(row["actor/clamped"] > 0.0 for row in rows[1:])


def test_correct_on_the_plain_loss_recomputes_and_truncates_pi_old_over_pi_behave(config, monkeypatch):
    monkeypatch.setenv(NOISE_VARIABLE, str(STD))
    proc = run_train(config, "experiment.name=correct_plain", *_budget(threshold=0.1, action="correct"))
    [line] = [line for line in proc.stderr.splitlines() if "mismatch over budget" in line]
    assert "at step 1" in line and "'tis'" in line and "from step 2 on" in line
    rows = read_metrics(_run_dir(config, "correct_plain") / "metrics.jsonl")
    assert [r["mismatch/correction_on"] for r in rows] == [0.0, 1.0, 1.0]
    # step 1: plain GRPO, no recompute (the mismatch measured in the first optimiser step) and no weight
    assert "offpolicy/behave_ratio_max" not in rows[0] and "actor/behave_weight_max" not in rows[0]
    assert rows[0]["mismatch/abs_logprob_diff"] > 0.1
    # from step 2: pi_old recomputed, the surrogate weighted by pi_old / pi_behave truncated at 2
    for row in rows[1:]:
        assert row["timing/logprobs_s"] > 0.0 and "offpolicy/behave_ratio_max" in row
        assert row["actor/behave_weight_max"] <= 2.0 + 1e-6
        assert (row["actor/clamped"] > 0.0) == (row["offpolicy/behave_ratio_max"] > 2.0)
    assert any(row["actor/clamped"] > 0.0 for row in rows[1:])


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (_budget(action="stop"), "algorithm.mismatch_budget.threshold, which is null"),
        (
            [
                "algorithm.loss.use_decoupled_loss=true",
                "algorithm.rejection_sampling.name=tis",
                *_budget(threshold=0.1, action="correct"),
            ],
            "algorithm.rejection_sampling ('tis') is on from the start",
        ),
        (_budget(metric="entropy"), "algorithm.mismatch_budget.metric"),
    ],
)
def test_a_misconfigured_budget_is_one_line_at_load(config, overrides, words):
    proc = run_train(config, "experiment.name=bad", *overrides, expect=2)
    assert "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if "algorithm.mismatch_budget" in line]
    assert words in line, proc.stderr
