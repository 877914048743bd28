"""Timeouts and failures the run goes past are said (core_rl/plugins/tally.py,
core_rl/loops/rl/failed_steps.py), and the pieces the deadlines are made of (core_rl/reliability/deadlines.py,
core_rl/reliability/own_loop.py, core_rl/reliability/loop_watch.py). End to end: the issue's case, an environment whose
every step hangs awaiting (``await asyncio.sleep``), used to end with exit status 0 and reward 0,
printing nothing; now each step warns and counts ``plugins/environment.block/timeouts``, and the
third such step in a row ends the run with exit status 1 and one line naming the environment."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from core_rl.loops.rl.failed_steps import AgentErrorsError, FailedEpisodes, FailedSteps, FailedStepsError
from core_rl.loops.rl.reward_runner import TIMEOUT, ItemFailure, ScoreResult
from core_rl.plugins.tally import PluginTally, tally_metrics, warnings_for
from core_rl.protocol import Sample
from core_rl.reliability.deadlines import DeadlinePassed, call_with_deadline
from core_rl.reliability.loop_watch import BEAT_S, LoopWatch
from core_rl.reliability.own_loop import PROBE_S, OwnLoop, stuck_loops
from core_rl.reliability.progress import PROGRESS
from core_rl.rollout.workflows import DROPPED_ERRORS, ERROR, ERROR_LIMIT, FAILED
from core_rl.testing import preloaded
from core_rl.testing.blocking import in_environment
from core_rl.testing.faults import build_task, merged, run_dir
from fault_helpers import cli_command, cli_env, write_config


def test_a_call_past_its_deadline_names_the_plugin_and_is_left_to_a_daemon_thread() -> None:
    release = threading.Event()
    seen: list[str] = []

    def block() -> None:
        seen.extend(c.label for c in PROGRESS.snapshot().calls)  # registered for the watchdog
        release.wait()

    start = time.monotonic()
    with pytest.raises(DeadlinePassed) as caught:
        call_with_deadline("logger 'x' (distribution d 1)", "log (step 3)", 0.3, "trainer.logger_timeout_s", block)
    assert 0.3 <= time.monotonic() - start < 2
    assert str(caught.value).startswith(
        "logger 'x' (distribution d 1): log (step 3) did not return within 0.3 s (trainer.logger_timeout_s)"
    )
    assert "\n" not in str(caught.value)
    (thread,) = [t for t in threading.enumerate() if t.name == "deadline log (step 3)"]
    assert thread.daemon  # never keeps the process alive at exit
    assert seen == ["logger 'x' (distribution d 1): log (step 3)"]
    release.set()
    thread.join(5)
    # a call that returns or raises in time comes back as it is
    assert call_with_deadline("w", "f", 5, "k", lambda a, b: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="boom"):
        call_with_deadline("w", "f", 5, "k", lambda: {}["boom"])


def test_a_coroutine_that_blocks_its_loop_is_cut_and_the_loop_is_stuck() -> None:
    """On the caller's loop the timeout fires although the coroutine blocks its own loop; the loop
    is then stuck (counted, and it refuses further calls at once). An awaiting hang is cut without
    the loop being stuck, and the loop goes on serving."""
    release = threading.Event()

    async def blocks() -> None:
        release.wait()  # blocks the loop it runs on

    async def hangs() -> None:
        await asyncio.sleep(3600)

    async def answer() -> int:
        return 42

    async def fails() -> None:
        raise ValueError("env broke")

    async def main() -> None:
        free = OwnLoop("free")
        assert await free.run(answer(), 5) == 42
        with pytest.raises(ValueError, match="env broke"):
            await free.run(fails(), 5)
        with pytest.raises(TimeoutError):
            await free.run(hangs(), 0.2)
        assert not free.stuck and await free.run(answer(), 5) == 42
        free.close()

        before = stuck_loops()
        blocked = OwnLoop("blocked")
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await blocked.run(blocks(), 0.3)
        assert time.monotonic() - start < 0.3 + PROBE_S + 1
        assert blocked.stuck and stuck_loops() == before + 1
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await blocked.run(answer(), 10)
        assert time.monotonic() - start < 1  # refused at once
        release.set()
        blocked.close()

    asyncio.run(main())


def test_the_tally_gives_metrics_and_warns_past_the_fraction() -> None:
    tally = PluginTally()
    for _ in range(8):
        tally.record("environment.calc", "environment 'calc' (distribution d 1)")
    tally.record("environment.calc", "environment 'calc' (distribution d 1)", timeouts=1, what="step past 5 s")
    tally.record("environment.calc", "environment 'calc' (distribution d 1)", errors=1)
    tally.record("reward.r", "reward 'r' (distribution d 1)", timeouts=1, said=True)
    taken = tally.take()
    assert tally.take() == {}  # taken once
    assert tally_metrics(taken) == {
        "plugins/environment.calc/calls": 10.0,
        "plugins/environment.calc/timeouts": 1.0,
        "plugins/environment.calc/errors": 1.0,
        "plugins/reward.r/calls": 1.0,
        "plugins/reward.r/timeouts": 1.0,
        "plugins/reward.r/errors": 0.0,
    }
    # 2 of 10 failed: past 0.1, not past 0.2; the reward warns of its failures itself
    assert warnings_for(taken, 4, 0.1, "trainer.warn_failure_fraction") == [
        "core-rl: warning: step 4: environment 'calc' (distribution d 1): 2 of 10 calls failed "
        "(1 timed out (step past 5 s), 1 raised), more than trainer.warn_failure_fraction=0.1 of them"
    ]
    assert warnings_for(taken, 4, 0.2, "trainer.warn_failure_fraction") == []


def _samples(n: int, failed: int) -> list[Sample]:
    return [
        Sample(
            prompt_ids=[1],
            response_ids=[2],
            logprobs=[0.0],
            weight_version=0,
            finish_reason="stop",
            info={FAILED: "step timed out"} if i < failed else {},
        )
        for i in range(n)
    ]


def test_failed_episodes_and_the_limit_on_failed_steps_in_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    episodes = FailedEpisodes()
    scored = ScoreResult([0.0] * 4, [ItemFailure(3, TIMEOUT, "score did not return")])
    episodes.add(_samples(4, 2), scored)  # 2 timed out in the environment, 1 in the reward
    assert (episodes.failed, episodes.total) == (3, 4)
    assert episodes.why({}) == "step timed out: 2; reward timeout: 1"

    steps = FailedSteps(limit=2)
    assert steps.check(1, 3, 4, "x")["rollout/failed_step"] == 0.0  # one episode trained
    assert steps.check(2, 4, 4, "env hung")["rollout/failed_steps_total"] == 1.0
    assert "core-rl: warning: step 2: every episode failed (4 of 4: env hung); 1 such step(s) in a row" in (
        capsys.readouterr().err
    )
    assert steps.check(3, 0, 4, "")["rollout/failed_step"] == 0.0  # the streak ends
    steps.check(4, 4, 4, "env hung")
    resumed = FailedSteps(limit=2)  # the count carries over a resume
    resumed.load_state_dict(steps.state_dict())
    with pytest.raises(FailedStepsError, match=r"^step 5: every episode failed .* 2 such step\(s\) in a row, 3 in all"):
        resumed.check(5, 4, 4, "env hung")
    assert FailedSteps(limit=0).check(1, 4, 4, "x")["rollout/failed_step"] == 1.0  # no limit
    assert FailedSteps(limit=1).check(1, 0, 0, "")["rollout/failed_step"] == 0.0  # no episode: not failed


def test_agent_errors_are_counted_by_kind_and_stop_the_run_past_the_fraction() -> None:
    def sample(**info: object) -> Sample:
        return Sample([1], [2], [0.0], weight_version=0, finish_reason="stop", info=dict(info))

    limit = {ERROR_LIMIT: 0.75}
    failed = {FAILED: "agent error: MaxTurnsExceeded: Max turns (2)\nexceeded", **limit}
    batch = [
        sample(**{ERROR: "MaxTurnsExceeded", **failed}),
        sample(**{ERROR: "ModelBehaviorError", FAILED: "agent error: bad JSON", **limit}),
        sample(**{DROPPED_ERRORS: {"MaxTurnsExceeded": 1}, **limit}),  # one more episode, left out
        sample(),
    ]
    episodes = FailedEpisodes()
    episodes.add(batch, ScoreResult([0.0] * 4, []))
    assert (episodes.failed, episodes.total) == (2, 5)  # the dropped episode counts among the step's
    metrics = episodes.error_metrics(1)
    assert metrics == {
        "agent/errors/MaxTurnsExceeded": 2.0,
        "agent/errors/ModelBehaviorError": 1.0,
        "agent/errors_total": 3.0,
    }  # 3 of 5 is within 0.75; a sample carrying a lower limit sets the step's:
    episodes.add([sample(**{ERROR: "MaxTurnsExceeded", **failed, ERROR_LIMIT: 0.25})], ScoreResult([0.0], []))
    with pytest.raises(AgentErrorsError) as caught:
        episodes.error_metrics(2)
    message = str(caught.value)
    assert message.startswith(
        "step 2: 4 of 6 episodes ended in an agent error, past rollout.workflow.max_error_fraction=0.25"
    )
    assert "most common: MaxTurnsExceeded (3): agent error: MaxTurnsExceeded: Max turns (2) exceeded;" in message
    assert "\n" not in message and AgentErrorsError.exit_code == 1
    assert FailedEpisodes().error_metrics(1) == {}  # no error: no metric


def test_an_environment_whose_every_step_hangs_awaiting(tmp_path: Path) -> None:
    """The issue's case, with the defaults (``max_consecutive_failed_steps`` 3,
    ``warn_failure_fraction`` 0.1): steps 1 and 2 warn and count; step 3 ends the run."""
    pytest.importorskip("core_rl_fsdp")
    pytest.importorskip("core_rl_hf")
    config = merged(
        in_environment(build_task(tmp_path), 1, awaiting=True), trainer={"total_steps": 6, "torch_threads": 1}
    )
    path = write_config(config, tmp_path / "run.yaml")
    done = preloaded.run(
        cli_command("train", str(path), faults=True), capture_output=True, text=True, env=cli_env(), timeout=300
    )
    assert done.returncode == 1, done.stderr[-4000:]
    err = done.stderr
    assert "Traceback" not in err, err[-4000:]
    (line,) = [x for x in err.splitlines() if x.startswith("core-rl: error:")]
    assert line.startswith("core-rl: error: step 3: every episode failed (8 of 8: step timed out: 8; ")
    assert "environment 'block' (distribution core-rl-testing-faults 0): 8 calls timed out" in line
    assert "algorithm.max_consecutive_failed_steps=3" in line
    for step in (1, 2):
        warned = [x for x in err.splitlines() if x.startswith(f"core-rl: warning: step {step}: ")]
        assert any("environment 'block' (distribution core-rl-testing-faults 0): 8 of " in x for x in warned), err
        assert any("every episode failed" in x for x in warned), err
    rows = [json.loads(x) for x in (run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    assert [r["plugins/environment.block/timeouts"] for r in rows] == [8.0, 8.0]
    assert [r["rollout/failed_steps_total"] for r in rows] == [1.0, 2.0]
    assert [r["rollout/failed_episodes"] for r in rows] == [8.0, 8.0]


def test_a_blocked_loop_is_found_from_outside_and_named() -> None:
    """:class:`LoopWatch` on a loop whose coroutine calls ``time.sleep``: stalled past its bound,
    naming this file, the line and the function it is blocked in; not stalled once it runs again."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    watch = LoopWatch(loop, thread, stall_s=0.5)
    release = threading.Event()

    async def blocks_the_loop() -> None:
        release.wait(30)

    try:
        time.sleep(BEAT_S * 2)
        assert watch.stalled() is None
        future = asyncio.run_coroutine_threadsafe(blocks_the_loop(), loop)
        deadline = time.monotonic() + 10
        while (stall := watch.stalled()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stall is not None and stall.startswith("blocked for ")
        assert f"{__file__}:" in stall and stall.endswith(" in blocks_the_loop"), stall
        release.set()
        future.result(5)
        time.sleep(BEAT_S * 3)
        assert watch.stalled() is None
    finally:
        release.set()
        watch.stop()
        loop.call_soon_threadsafe(loop.stop)
