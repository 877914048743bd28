"""Plugin code that blocks cannot freeze a run (core_rl/reliability/deadlines.py, core_rl/reliability/own_loop.py),
on real
``core-rl train`` processes with the plugins of core_rl/testing/blocking.py: a reward whose third
``score`` call sleeps a day, an environment whose ``async def step`` calls ``time.sleep`` (blocking
its event loop), a sample filter and a logger that sleep. Each run ends within its deadline plus a
bound with exit status 1 and one line naming the plugin and its distribution, leaves no process
behind, and a resume (``trainer.resume=true``) continues from the last checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from core_rl.testing import preloaded
from core_rl.testing.blocking import in_environment
from core_rl.testing.faults import build_task, finish, merged, run_dir
from core_rl.testing.launch import cpu_ranks_env
from core_rl_server_kit.supervise import session_members
from fault_helpers import cli_command, cli_env, write_config

pytestmark = [pytest.mark.filterwarnings("ignore")]

#: what a run may take past its deadline: the steps before the block (tiny), start-up and exit
BOUND_S = 90.0
DISTRIBUTION = "(distribution core-rl-testing-faults 0)"


def _config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    pytest.importorskip("core_rl_fsdp")
    pytest.importorskip("core_rl_hf")
    return merged(build_task(tmp_path), **sections)


def _train(config: dict[str, Any], *overrides: str, timeout: float, ranks: int = 1) -> tuple[int, str, float]:
    """``core-rl train`` (with the test plugins) on ``config`` in a session of its own, on ``ranks``
    CPU ranks: its exit status, stderr and seconds taken. Asserts that nothing of its session is
    left afterwards."""
    path = write_config(
        config, Path(config["experiment"]["output_dir"]).parent / f"{config['experiment']['name']}.yaml"
    )
    start = time.monotonic()
    launch = ("--nproc-per-node", str(ranks)) if ranks > 1 else ()
    proc = preloaded.Popen(
        cli_command("train", *launch, str(path), *overrides, faults=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cpu_ranks_env(cli_env()) if ranks > 1 else cli_env(),
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        err = finish(proc, 5)
        raise AssertionError(f"the run did not end within {timeout} s:\n{err[-4000:]}") from None
    took = time.monotonic() - start
    assert not session_members(proc.pid), "processes of the run were left behind"
    return proc.returncode, err, took


def _error_line(err: str) -> str:
    """The run's one error line; asserts there is exactly one and no traceback."""
    assert "Traceback" not in err, err[-4000:]
    lines = [x for x in err.splitlines() if x.startswith("core-rl: error:")]
    assert len(lines) == 1, err[-4000:]
    return lines[0]


def _logged_steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _resumes_from(config: dict[str, Any], step: int, total: int) -> None:
    """A resume of ``config`` (the blocking call now at a later call of the new process, so the run
    gets past it) continues from the checkpoint of ``step`` and completes step ``total``."""
    status, err, _ = _train(config, "trainer.resume=true", timeout=300)
    assert status == 0, err[-4000:]
    assert f"step_{step:08d}" in err, err[-4000:]  # the resume note names the checkpoint it continues from
    steps = _logged_steps(run_dir(config))
    assert steps == list(range(1, total + 1)), steps


def test_a_reward_that_blocks_in_its_third_call(tmp_path: Path) -> None:
    """One ``score`` call per step (8 items): the third call sleeps a day. Past
    ``reward_runner.timeout_s`` every item of step 3 fails, more than ``max_error_fraction``: the
    run stops with one line naming the reward, its distribution, the call and the wait."""
    config = _config(tmp_path, reward={"name": "block", "call": 3}, reward_runner={"timeout_s": 3})
    status, err, took = _train(config, timeout=3 + BOUND_S + 60)
    assert status == 1, err[-4000:]
    line = _error_line(err)
    assert f"reward 'block' {DISTRIBUTION} failed on 8 of 8 items of step 3" in line, line
    assert "score did not return within 3 s (reward_runner.timeout_s)" in line, line
    assert took < 3 + BOUND_S, took
    assert _logged_steps(run_dir(config)) == [1, 2]
    _resumes_from(merged(config, reward={"name": "block", "call": 99}), 2, 4)


def test_an_environment_whose_async_step_blocks_the_event_loop(tmp_path: Path) -> None:
    """Every step of the ``block`` environment from the 9th of the process on calls
    ``time.sleep(10**6)`` inside ``async def step``: step 1's 8 trajectories pass, then every
    trajectory of steps 2 and 3 is cut at ``tool_timeout_s`` (the environment runs on a loop of its
    own, so the timeout fires), every episode fails, and two such steps in a row stop the run with
    one line naming the environment, its distribution, the call and the wait."""
    config = merged(
        in_environment(_config(tmp_path), 2, from_call=9), algorithm={"name": "grpo", "max_consecutive_failed_steps": 2}
    )
    status, err, took = _train(config, timeout=2 * 2 + BOUND_S + 60)
    assert status == 1, err[-4000:]
    line = _error_line(err)
    assert "step 3: every episode failed (8 of 8: step timed out: 8;" in line, line
    assert (
        f"environment 'block' {DISTRIBUTION}: 8 calls timed out (step past rollout.workflow.tool_timeout_s=2 s)" in line
    )
    assert "algorithm.max_consecutive_failed_steps=2" in line, line
    assert took < 2 * 2 + BOUND_S, took
    warned = [x for x in err.splitlines() if x.startswith("core-rl: warning: step 2:")]
    assert any("every episode failed" in x for x in warned), err[-4000:]
    assert any(f"environment 'block' {DISTRIBUTION}: 8 of 16 calls failed (8 timed out" in x for x in warned), warned
    rows = [json.loads(x) for x in (run_dir(config) / "metrics.jsonl").read_text().splitlines()]
    assert [r["plugins/environment.block/timeouts"] for r in rows] == [0.0, 8.0]
    assert [r["rollout/failed_step"] for r in rows] == [0.0, 1.0]
    # the resumed process's first 8 steps pass again: step 3 trains, step 4 fails (one, below the limit)
    _resumes_from(config, 2, 4)


def test_a_workflow_that_blocks_the_controllers_event_loop(tmp_path: Path) -> None:
    """The workflow's fifth ``run`` (the first trajectory of step 3) calls ``time.sleep`` inside
    ``async def run``, blocking the rollout controller's loop: no timeout on that loop can fire,
    but the loop's watch finds it past ``rollout.controller.workflow_timeout_s`` and the run stops
    with one line naming the workflow and where the loop is blocked."""
    config = _config(tmp_path)
    config["rollout"] = {
        **config["rollout"],
        "workflow": {"name": "block", "call": 5},
        "controller": {"workflow_timeout_s": 3},
    }
    status, err, took = _train(config, timeout=3 + BOUND_S + 60)
    assert status == 1, err[-4000:]
    line = _error_line(err)
    assert (
        f"workflow 'block' {DISTRIBUTION}: the rollout controller's event loop, where the workflow runs, is blocked"
        in line
    )
    assert "core_rl/testing/blocking.py:" in line and " in run (rollout.controller.workflow_timeout_s=3)" in line, line
    assert took < 3 + BOUND_S, took
    assert _logged_steps(run_dir(config)) == [1, 2]
    config["rollout"]["workflow"] = {"name": "block", "call": 99}
    _resumes_from(config, 2, 4)


def test_a_sample_filter_that_blocks(tmp_path: Path) -> None:
    """The filter's third call (step 3) sleeps a day: past ``algorithm.filter_timeout_s`` the run
    stops with one line naming the filter, its place in the config and its distribution."""
    config = _config(
        tmp_path, algorithm={"name": "grpo", "filters": [{"name": "block", "call": 3}], "filter_timeout_s": 3}
    )
    status, err, took = _train(config, timeout=3 + BOUND_S + 60)
    assert status == 1, err[-4000:]
    line = _error_line(err)
    assert "sample filter 'block' (algorithm.filters[0], distribution core-rl-testing-faults): filter did not " in line
    assert "return within 3 s (algorithm.filter_timeout_s)" in line, line
    assert took < 3 + BOUND_S, took
    assert _logged_steps(run_dir(config)) == [1, 2]
    _resumes_from(config, 2, 4)


def test_a_logger_that_blocks(tmp_path: Path) -> None:
    """The logger's ``log`` of step 3 sleeps a day: past ``trainer.logger_timeout_s`` the run
    stops with one line naming the logger, before step 3 is saved, so the resume redoes it."""
    config = _config(
        tmp_path, loggers=[{"name": "block", "step": 3}], trainer={"total_steps": 4, "logger_timeout_s": 3}
    )
    status, err, took = _train(config, timeout=3 + BOUND_S + 60)
    assert status == 1, err[-4000:]
    line = _error_line(err)
    assert f"logger 'block' {DISTRIBUTION}: log (step 3) did not return within 3 s (trainer.logger_timeout_s)" in line
    assert took < 3 + BOUND_S, took
    assert not (run_dir(config) / "checkpoints" / "step_00000003").exists()
    _resumes_from(merged(config, loggers=[{"name": "block", "step": 99}]), 2, 4)


@pytest.mark.parametrize("kind", ["reward", "filter"])
def test_a_deadline_on_one_rank_stops_every_rank(tmp_path: Path, kind: str) -> None:
    """Under ``--nproc-per-node 2``: the blocking call passes its deadline on the rank that makes it,
    and the other rank, waiting in the step's collective, does not outlive it: the run ends within
    the deadline plus the bound with one line naming the plugin (rank 1 repeats it as rank 0's
    failure, and the launcher points at it), no process left, and step 2 the last logged."""
    if kind == "reward":
        sections: dict[str, Any] = {"reward": {"name": "block", "call": 3}, "reward_runner": {"timeout_s": 3}}
        words = "score did not return within 3 s (reward_runner.timeout_s)"
    else:
        sections = {"algorithm": {"name": "grpo", "filters": [{"name": "block", "call": 3}], "filter_timeout_s": 3}}
        words = "filter did not return within 3 s (algorithm.filter_timeout_s)"
    config = _config(tmp_path, **sections)
    status, err, took = _train(config, timeout=3 + BOUND_S + 120, ranks=2)
    assert status == 1, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    # rank 0 says it; rank 1 stops with rank 0's message; the launcher names the rank that exited
    # first (either: both stop at the same agreement point) and points at them
    lines = [x.removeprefix("core-rl: error: ") for x in err.splitlines() if x.startswith("core-rl: error:")]
    peers = [x for x in lines if x.startswith("rank ")]
    own_lines = [x for x in lines if x not in peers]
    assert len(own_lines) == 1, err
    own = own_lines[0]
    assert "'block'" in own and words in own, own
    assert len(peers) == 2 and f"rank 0 failed: {own}" in peers, err
    assert any(re.fullmatch(r"rank [01] exited with status 1 \(its message is above\)", x) for x in peers), err
    assert took < 3 + BOUND_S + 60, took  # two ranks start and end slower than one
    assert _logged_steps(run_dir(config)) == [1, 2]
