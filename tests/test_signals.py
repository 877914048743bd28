"""Real signals sent to a real ``core-rl train`` process at a random moment of training: SIGINT
and SIGTERM finish the step, save a checkpoint and exit with status 3 and a message; SIGKILL
just kills. Each run is then resumed and must equal an uninterrupted run bit for bit. A second
signal (not a near-simultaneous duplicate) stops at once, without saving. A step that never
finishes stops the run ``trainer.stop_grace_s`` after SIGTERM, without saving, keeping the newest
checkpoint, from which the run resumes."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from core_rl.plugins.host import PluginHost
from core_rl.reliability.progress import STALL_MARKER_VARIABLE, STALL_VARIABLE
from core_rl.testing import preloaded
from core_rl.testing.faults import finish, wait_for_file, wait_for_random_moment, wait_for_steps
from fault_helpers import (
    build_task,
    checkpoint,
    cli_command,
    cli_env,
    merged,
    run_dir,
    stable_metrics,
    state_digest,
    train_here,
    write_config,
)

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")

STEPS = 12


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    config = build_task(tmp_path_factory.mktemp("signals"))
    return merged(config, trainer={"total_steps": STEPS}, saver={"every_n_steps": 5, "keep_last": 2})


@pytest.fixture(scope="module")
def straight(base) -> dict:
    config = merged(base, experiment={"name": "straight"})
    train_here(config, PluginHost(environ={}))
    return config


def start(config: dict, *, faults: bool = False) -> subprocess.Popen:
    path = write_config(
        config, Path(config["experiment"]["output_dir"]).parent / f"{config['experiment']['name']}.yaml"
    )
    return preloaded.Popen(
        cli_command("train", str(path), faults=faults),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        start_new_session=True,
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_signal_at_a_random_moment_then_resume_is_bitwise(base, straight, sig):
    seed = random.randrange(10**6)
    config = merged(base, experiment={"name": f"sig-{sig.name}"}, recover={"mode": "auto"})
    proc = start(config)
    try:
        moment = wait_for_random_moment(run_dir(config), proc, random.Random(seed), STEPS)
        assert moment is not None, finish(proc, 60)[-3000:]
        proc.send_signal(sig)
    finally:
        err = finish(proc, 240)
    note = f"({sig.name} {moment}; seed {seed})"
    run = run_dir(config)
    logged = sorted(stable_metrics(run))
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL, note
    else:
        last = logged[-1]
        assert proc.returncode == 3, f"{note}\n{err[-3000:]}"
        assert "Traceback" not in err, note
        assert f"received {sig.name}: finishing the current step" in err, note
        assert f"stopped by {sig.name} after step {last} of {STEPS}; checkpoint {checkpoint(run, last)}" in err
        assert (run / "checkpoints" / "latest").read_text() == checkpoint(run, last).name
        assert logged == list(range(1, last + 1)), note
    train_here(config, PluginHost(environ={}))  # resume
    assert stable_metrics(run) == stable_metrics(run_dir(straight)), note
    assert state_digest(checkpoint(run, STEPS)) == state_digest(checkpoint(run_dir(straight), STEPS)), note


def test_a_second_signal_stops_at_once_and_a_duplicate_does_not(base, tmp_path):
    """Each reward call sleeps 12 s: the first SIGTERM comes once step 2's call has started (after
    step 1's stop check, so the stop is due at the end of step 2), a duplicate 0.1 s later is
    ignored, a second one 2.5 s after the first kills the process before the step ends. (Sent as
    soon as step 1 was logged, the first SIGTERM could land before step 1's stop check, and that
    stop was honoured, with a checkpoint, before the second one.)"""
    calls = tmp_path / "reward-calls"
    config = merged(
        base,
        experiment={"name": "twice"},
        reward={"name": "misbehave", "mode": "slow", "sleep_s": 12.0, "calls_file": str(calls)},
        reward_runner={"items_per_call": 0, "timeout_s": 60},
        saver={"every_n_steps": 0, "at_end": True},
    )
    proc = start(config, faults=True)
    try:
        assert wait_for_steps(run_dir(config), proc), finish(proc, 60)[-3000:]
        assert wait_for_file(calls, proc, lines=2), finish(proc, 60)[-3000:]  # step 2's call began
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(2.4)  # well past the repeat window (1 s from when the first was handled, late or not)
        assert proc.poll() is None  # the duplicate did not stop it
        proc.send_signal(signal.SIGTERM)
    finally:
        err = finish(proc, 60)
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert err.count("received SIGTERM: finishing the current step") == 1
    assert "received SIGTERM again: stopping at once, without saving" in err
    assert not list((run_dir(config) / "checkpoints").glob("step_*"))


def test_a_crash_in_native_code_prints_where_each_thread_was(base, tmp_path):
    """A SIGSEGV (here raised by the ``crash_once`` logger at step 2, as a crash inside a native
    library would be) kills the run with that signal, and Python's stack of every thread, the
    crashing frame among them, is on its standard error (:func:`core_rl.cli.report_fatal_signals`)."""
    config = merged(
        base,
        experiment={"name": "segfault"},
        loggers=[{"name": "crash_once", "step": 2, "marker": str(tmp_path / "crashed"), "how": "segfault"}],
        saver={"every_n_steps": 0, "at_end": False},
    )
    proc = start(config, faults=True)
    err = finish(proc, 240)
    assert proc.returncode == -signal.SIGSEGV, err[-3000:]
    assert "Fatal Python error: Segmentation fault" in err, err[-3000:]
    assert re.search(r'testing/faults\.py", line \d+ in log\n', err), err[-3000:]
    assert (tmp_path / "crashed").is_file()


def test_sigterm_during_a_stuck_step_stops_within_the_grace_without_saving(base, straight):
    """The step never finishes (the run is told to sleep inside its ``train_step`` of step 7):
    SIGTERM after step 6 ends the run ``trainer.stop_grace_s`` (5 s) later, with status 128 + 15
    and a message naming the stuck phase and call and the checkpoint kept (step 5's, the newest;
    nothing of step 6 or 7 saved). Resumed, the run ends as the uninterrupted one."""
    config = merged(base, experiment={"name": "stuck-sigterm"}, recover={"mode": "auto"}, trainer={"stop_grace_s": 5})
    run = run_dir(config)
    path = write_config(config, Path(config["experiment"]["output_dir"]).parent / "stuck-sigterm.yaml")
    stuck = path.with_name("stuck-sigterm.stalled")
    proc = preloaded.Popen(
        cli_command("train", str(path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**cli_env(), STALL_VARIABLE: "0:7:train_step", STALL_MARKER_VARIABLE: str(stuck)},
        start_new_session=True,
    )
    try:
        assert wait_for_steps(run, proc, 6), finish(proc, 60)[-3000:]
        # inside step 7's train_step (after step 6's stop check)
        assert wait_for_file(stuck, proc), finish(proc, 60)[-3000:]
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        err = finish(proc, 60)
    finally:
        finish(proc, 1)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert 5 <= took < 5 + 10, took
    assert "Traceback" not in err
    assert "received SIGTERM: finishing the current step" in err
    (line,) = [x for x in err.splitlines() if "did not finish within" in x]
    assert line.startswith(
        "core-rl: the current step did not finish within trainer.stop_grace_s (5 s) of SIGTERM: stopping without "
        "saving (stuck in update of step 7, in train engine 'fsdp' (distribution core-rl-fsdp"
    ), line
    assert line.endswith(
        f"The newest complete checkpoint is {checkpoint(run, 5)}, as it was; continue from it with recover.mode=auto"
    )
    assert (run / "checkpoints" / "latest").read_text() == checkpoint(run, 5).name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", checkpoint(run, 5).name]
    assert sorted(stable_metrics(run)) == list(range(1, 7))
    train_here(config, PluginHost(environ={}))  # resume: from step 5, as if never stopped
    assert stable_metrics(run) == stable_metrics(run_dir(straight))
    assert state_digest(checkpoint(run, STEPS)) == state_digest(checkpoint(run_dir(straight), STEPS))
