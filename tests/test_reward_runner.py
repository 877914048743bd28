"""The reward runner: every way a reward can misbehave (raise, hang, NaN, inf, strings, None, a
wrong count) gives the configured ``on_error`` per item, counted and logged; calls run
concurrently; a hanging call neither blocks the step nor the process's exit."""

from __future__ import annotations

import json
import math
import re
import sys
import threading

import pytest
from core_rl.config.loader import structure
from core_rl.config.schema import RewardRunnerConfig
from core_rl.errors import ConfigError
from core_rl.interfaces import Reward
from core_rl.loops.errors import RewardError
from core_rl.loops.rl.reward_runner import (
    EXCEPTION,
    NONFINITE,
    NOT_A_NUMBER,
    TIMEOUT,
    RewardErrorLog,
    RewardRunner,
)
from core_rl.plugins.kinds import REWARD
from core_rl.testing import make_reward_input, preloaded
from core_rl.testing.faults import RELEASE, FaultPlugin, MisbehaveConfig

ITEMS = [make_reward_input("x" * (i + 1), prompt=f"p{i}") for i in range(8)]


def runner(host, mode: str, *, every: int = 2, **cfg) -> RewardRunner:
    """A runner around the inline ``misbehave`` reward, built the way the trainer builds it."""
    reward = host.get(REWARD, "misbehave").factory(MisbehaveConfig(mode=mode, every=every))
    options = {"items_per_call": 1, "timeout_s": 2.0, "max_error_fraction": 1.0, **cfg}
    return RewardRunner(reward, "misbehave", RewardRunnerConfig(**options))


@pytest.fixture
def host(host):
    host.register_plugin(FaultPlugin(), distribution="core-rl-test-faults", version="0")
    return host


@pytest.fixture(autouse=True)
def _release_hung_calls():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize(
    ("mode", "kind"),
    [("raise", EXCEPTION), ("nan", NONFINITE), ("inf", NONFINITE), ("string", NOT_A_NUMBER), ("none", NOT_A_NUMBER)],
)
def test_each_misbehaviour_gets_the_error_value(host, mode, kind):
    r = runner(host, mode, on_error="value", error_value=-1.0)
    result = r.score(ITEMS)
    # items_per_call=1: each item is index 0 of its own call, so every item misbehaves
    assert [f.kind for f in result.failures] == [kind] * 8
    assert result.scores == [-1.0] * 8
    r.close()


def test_mixed_calls_fail_only_their_items(host):
    r = runner(host, "nan", items_per_call=2, on_error="value", error_value=0.25)
    result = r.score(ITEMS)
    # in each call of 2 items, the first (index 0 of the call) is NaN, the second scores len/10
    assert [f.index for f in result.failures] == [0, 2, 4, 6]
    assert result.scores == [0.25, 0.2, 0.25, 0.4, 0.25, 0.6, 0.25, 0.8]
    r.close()


def test_a_raising_call_fails_all_its_items(host):
    r = runner(host, "raise", items_per_call=4, on_error="value")
    result = r.score(ITEMS)
    assert [f.index for f in result.failures] == list(range(8))
    assert all("ValueError: misbehave: this reward raises" in f.error for f in result.failures)
    r.close()


def test_drop_removes_failed_items(host):
    r = runner(host, "inf", items_per_call=2, on_error="drop")
    result = r.score(ITEMS)
    assert result.kept == [1, 3, 5, 7]
    assert result.scores[0] is None and result.scores[1] == pytest.approx(0.2)
    r.close()


def test_stop_names_the_reward_the_item_and_the_error(host):
    r = runner(host, "string", items_per_call=2, on_error="stop")
    with pytest.raises(RewardError) as err:
        r.score(ITEMS, step=7)
    message = str(err.value)
    assert "reward 'misbehave' failed on item 0 of step 7" in message
    assert "prompt 'p0', response 'x'" in message
    assert "score is not a number: str '0.5'" in message
    assert "(and 3 more items)" in message and "reward_runner.on_error=stop" in message
    r.close()


def test_wrong_count_always_stops(host):
    r = runner(host, "wrong_count", items_per_call=4, on_error="value")
    with pytest.raises(RewardError, match="reward 'misbehave' returned 3 scores for 4 items"):
        r.score(ITEMS)
    r.close()


def test_too_many_failures_stop_whatever_on_error_says(host):
    r = runner(host, "nan", items_per_call=2, on_error="value", max_error_fraction=0.25)
    with pytest.raises(RewardError, match=r"failed on 4 of 8 items of step 3 \(nonfinite.*max_error_fraction=0.25"):
        r.score(ITEMS, step=3)
    r.close()


def test_a_hanging_call_times_out_and_the_others_finish(host):
    r = runner(host, "hang", items_per_call=2, num_workers=2, timeout_s=0.3, on_error="value", error_value=0.0)
    result = r.score(ITEMS)
    # every call of 2 holds a misbehaving first item, so every call hangs and times out
    assert {f.kind for f in result.failures} == {TIMEOUT}
    assert len(result.failures) == 8 and "score did not return within 0.3 s" in result.failures[0].error
    # the pool replaced its stuck workers: a good reward call still runs
    r.reward.config.mode = "nan"
    assert len(r.score(ITEMS[:2]).failures) == 1
    r.close()


def test_calls_run_concurrently(host):
    """Four calls must be in flight at once to pass the barrier (no timing involved)."""
    barrier = threading.Barrier(4, timeout=20)

    class Rendezvous(Reward):
        def score(self, items):
            barrier.wait()
            return [1.0 for _ in items]

    r = RewardRunner(Rendezvous(), "rendezvous", RewardRunnerConfig(items_per_call=2, num_workers=4, timeout_s=30))
    result = r.score(ITEMS)
    assert result.scores == [1.0] * 8 and not result.failures
    r.close()


def test_a_hanging_reward_does_not_block_exit():
    """A process whose reward never returns still exits (the workers are daemon threads)."""
    code = (
        "from core_rl.config.schema import RewardRunnerConfig\n"
        "from core_rl.testing import make_reward_input\n"
        "from core_rl.loops.rl.reward_runner import RewardRunner\n"
        "from core_rl.testing.faults import MisbehaveConfig, MisbehavingReward\n"
        "r = RewardRunner(MisbehavingReward(MisbehaveConfig(mode='hang', every=1)), 'hang',"
        " RewardRunnerConfig(timeout_s=0.2, max_error_fraction=1.0))\n"
        "print(r.score([make_reward_input('a')]).failures[0].kind)\n"
    )
    proc = preloaded.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "timeout"


def test_error_log_records_items_and_truncates_on_resume(tmp_path, host):
    cfg = RewardRunnerConfig(items_per_call=2, on_error="value", max_error_fraction=1.0)
    r = runner(host, "nan", items_per_call=2)
    log = RewardErrorLog(tmp_path / "reward_errors.jsonl", "misbehave", cfg)
    log.start(None)
    for step in (1, 2, 3):
        metrics = log.record(step, ITEMS, r.score(ITEMS, step=step))
    assert metrics["reward/errors"] == 4 and metrics["reward/errors_total"] == 12
    assert metrics["reward/errors_nonfinite"] == 4 and metrics["reward/dropped"] == 0
    rows = [json.loads(line) for line in (tmp_path / "reward_errors.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    assert rows[0] == {
        "step": 1,
        "item": 0,
        "kind": "nonfinite",
        "error": "score is nan",
        "prompt": "p0",
        "response": "x",
    }
    RewardErrorLog(tmp_path / "reward_errors.jsonl", "misbehave", cfg).start(resume_step=2)
    rows = [json.loads(line) for line in (tmp_path / "reward_errors.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, 2] and len(rows) == 8
    r.close()


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"on_error": "ignore"}, "reward_runner.on_error: must be one of 'value', 'drop', 'stop'"),
        ({"timeout_s": 0}, "reward_runner.timeout_s: must be in (0.0, 10000000]"),
        ({"error_value": math.nan}, "reward_runner.error_value: expected a finite number"),
        ({"num_workers": 0}, "reward_runner.num_workers: must be in [1, 1024]"),
    ],
)
def test_reward_runner_section_is_validated(options, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        structure(options, RewardRunnerConfig, path="reward_runner")


class _PartsReward(Reward):
    """Scores 1.0; part ``applies`` is None on odd items, part ``broken`` is NaN on item 0."""

    def score_with_parts(self, items):
        from core_rl.interfaces import RewardScores

        n = len(items)
        return RewardScores(
            scores=[1.0] * n,
            parts={"applies": [None if i % 2 else 0.5 for i in range(n)], "broken": [math.nan] + [2.0] * (n - 1)},
        )

    def score(self, items):
        return self.score_with_parts(items).scores


def test_a_part_that_does_not_apply_is_left_out_and_a_nan_part_is_counted():
    from core_rl.loops.rl.batching import value_stats

    r = RewardRunner(_PartsReward(), "parts", RewardRunnerConfig(items_per_call=8))
    result = r.score(ITEMS)
    r.close()
    assert result.parts["applies"] == [0.5, None] * 4
    assert math.isnan(result.parts["broken"][0]) and result.parts["broken"][1:] == [2.0] * 7
    applies = value_stats("reward/applies", result.parts["applies"])
    assert applies == {
        "reward/applies/mean": 0.5,
        "reward/applies/std": 0.0,
        "reward/applies/max": 0.5,
        "reward/applies/min": 0.5,
    }
    broken = value_stats("reward/broken", result.parts["broken"])
    assert broken["reward/broken/nonfinite"] == 1.0 and broken["reward/broken/mean"] == 2.0
    assert value_stats("x", [None, None]) == {}


class _AnswersReward(Reward):
    """Scores 1.0 and reads answers: ``bad`` gives a number as an answer."""

    def __init__(self, bad: bool) -> None:
        self.bad = bad

    def score_with_parts(self, items):
        from core_rl.interfaces import RewardScores

        answers = [str(i) if i % 3 else None for i in range(len(items))]
        if self.bad:
            answers[1] = 7
        return RewardScores(scores=[1.0] * len(items), answers=answers)

    def score(self, items):
        return self.score_with_parts(items).scores


def test_answers_are_collected_across_calls_and_checked():
    r = RewardRunner(_AnswersReward(False), "answers", RewardRunnerConfig(items_per_call=3))
    assert r.score(ITEMS).answers == [None, "1", "2"] * 2 + [None, "1"]  # each call numbers its own items
    r.close()
    bad = RewardRunner(_AnswersReward(True), "answers", RewardRunnerConfig(items_per_call=8))
    with pytest.raises(RewardError, match=r"RewardScores.answers holds one str \(or None\) per item"):
        bad.score(ITEMS)
    bad.close()
    plain = RewardRunner(_PartsReward(), "parts", RewardRunnerConfig())
    assert plain.score(ITEMS).answers is None  # a reward that reads no answers
    plain.close()
