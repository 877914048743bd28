"""The progress watchdog (core_rl/reliability/watchdog.py) on real processes: a rank told to sleep
inside a step under ``core-rl train --nproc-per-node 2`` (gloo CPU ranks; the other rank then
waits for it in a real collective), and a real vLLM server paused with SIGSTOP while it generates.
Each run writes ``<run>/hang-<time>.txt`` with every rank's phase, calls in flight and thread
stacks, and ends with exit status 1 and one line naming the stuck phase and call. Also: how the
bound follows the recent steps, and how a call made inside another is named."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from core_rl.config.schema import WatchdogConfig
from core_rl.reliability.progress import STALL_VARIABLE, STEP, Progress
from core_rl.reliability.watchdog import bound
from core_rl.testing import preloaded
from core_rl.testing.faults import build_task, finish, merged, run_dir, wait_for_steps
from core_rl.testing.launch import cpu_ranks_env
from core_rl_server_kit.processes import pid_alive
from core_rl_server_kit.supervise import session_members
from fault_helpers import cli_command, cli_env, write_config

ROOT = Path(__file__).resolve().parents[1]
VLLM_EXAMPLE = ROOT / "examples" / "server_grpo" / "vllm.yaml"


def test_the_bound_follows_the_recent_steps_and_the_phase() -> None:
    config = WatchdogConfig(floor_s=10, factor=4, first_s=100)
    progress = Progress()
    assert bound(config, progress, STEP) == (100, "trainer.watchdog.first_s")  # no step timed yet
    progress.step_durations.extend([2.0, 5.0, 3.0])
    progress.longest["update"] = 1.0
    assert bound(config, progress, "update") == (20, "trainer.watchdog.factor 4 x the longest recent step (5 s)")
    assert bound(config, progress, STEP)[0] == 20
    assert bound(config, progress, "checkpoint") == (100, "trainer.watchdog.first_s")  # never completed yet
    progress.longest["checkpoint"] = 30.0  # a save takes longer than a step: its own history counts
    assert bound(config, progress, "checkpoint")[0] == 120
    progress.step_durations.clear()
    progress.step_durations.append(1.0)
    assert bound(config, progress, "update") == (10, "trainer.watchdog.floor_s")
    assert bound(WatchdogConfig(timeout_s=7), progress, "update") == (7, "trainer.watchdog.timeout_s")


def test_a_call_made_inside_another_is_named_as_part_of_it() -> None:
    """A server request inside the engine's generation request, in an asyncio task of its own (as
    ``asyncio.wait_for`` makes one): shown once, with both labels; a finished call is an advance."""
    progress = Progress()
    inside = asyncio.Event()
    release = asyncio.Event()

    async def post() -> None:
        with progress.call("POST http://127.0.0.1:1/v1/completions"):
            inside.set()
            await release.wait()

    async def request() -> None:
        with progress.call("vllm server vllm-0: generation request"):
            await asyncio.wait_for(post(), 10)

    async def main() -> tuple:
        task = asyncio.ensure_future(request())
        await inside.wait()
        seen = progress.snapshot()
        release.set()
        await task
        return seen

    with progress.phase("rollout"):
        before = progress.advances
        seen = asyncio.run(main())
        assert progress.advances == before + 2  # both calls returned
    assert [c.label for c in seen.calls] == [
        "vllm server vllm-0: generation request: POST http://127.0.0.1:1/v1/completions"
    ]
    assert seen.phase == "rollout" and not progress.snapshot().calls


def _hang_file(run: Path) -> Path:
    (path,) = run.glob("hang-*.txt")
    assert re.fullmatch(r"hang-\d{8}T\d{6}Z\.txt", path.name), path.name
    return path


def test_a_forked_child_begins_its_own_progress() -> None:
    """The process tracker a child inherits from a fork (the tests' preloaded interpreter, a data
    worker) starts over: the parent's step, phase, calls and clock are not the child's."""
    import json

    from core_rl.reliability.progress import PROGRESS

    PROGRESS.begin_step(4)
    read, write = os.pipe()
    try:
        with PROGRESS.phase("update"), PROGRESS.call("train engine 'fsdp': train_step"):
            time.sleep(0.5)
            pid = os.fork()
            if pid == 0:
                seen = PROGRESS.snapshot()
                os.write(write, json.dumps([seen.step, seen.phase, len(seen.calls), seen.phase_s]).encode())
                os._exit(0)
            parent = PROGRESS.snapshot()
    finally:
        PROGRESS.start()  # this test process's later runs begin as a new process's would
    os.close(write)
    os.waitpid(pid, 0)
    step, phase, calls, phase_s = json.loads(os.read(read, 4096))
    os.close(read)
    assert (parent.step, parent.phase, len(parent.calls)) == (4, "update", 1) and parent.phase_s >= 0.5
    assert (step, phase, calls) == (None, "starting", 0) and phase_s < 0.5


def test_a_rank_sleeping_inside_a_step_under_torchrun(tmp_path: Path) -> None:
    """Rank 1 sleeps inside its ``train_step`` of step 2 (the test hook); rank 0 waits for it in
    the update's all_reduce. Within the bound plus a few polls the run ends: one line naming rank
    1, the update of step 2 and the train engine's call, and rank 0's collective; the hang file
    holds both ranks' phases and stacks (rank 1's at the sleep, rank 0's in all_reduce)."""
    pytest.importorskip("core_rl_fsdp")
    pytest.importorskip("core_rl_hf")
    config = merged(
        build_task(tmp_path),
        experiment={"name": "stuck"},
        trainer={"total_steps": 6, "collective_timeout_s": 600, "watchdog": {"timeout_s": 15}},
    )
    path = write_config(config, tmp_path / "stuck.yaml")
    env = cpu_ranks_env({**cli_env(), STALL_VARIABLE: "1:2:train_step"})
    proc = preloaded.Popen(
        cli_command("train", "--nproc-per-node", "2", str(path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    run = run_dir(config)
    try:
        assert wait_for_steps(run, proc, 1, timeout=300), finish(proc, 60)[-4000:]
        stalled = time.monotonic()
    finally:
        err = finish(proc, 180)
    took = time.monotonic() - stalled
    assert proc.returncode == 1, err[-4000:]
    assert took < 15 + 60, took  # the bound, the polls, the reports and the launcher's own end
    assert "Traceback" not in err, err[-4000:]
    (line,) = [x for x in err.splitlines() if x.startswith("core-rl: error: no progress for")]
    assert "rank 1 is stuck in update of step 2, in train engine 'fsdp' (distribution core-rl-fsdp" in line
    assert "): train_step for " in line
    assert "rank 0 waits for it in a collective (all_reduce)" in line
    hang = _hang_file(run)
    assert line.endswith(f"Every thread's stack on every rank: {hang}")
    assert "core-rl: error: rank 0 exited with status 1 (its message is above)" in err
    text = hang.read_text()
    rank0, rank1 = text.split("== rank 0 ")[1].split("== rank 1 ")
    assert "phase: update of step 2" in rank0 and "phase: update of step 2" in rank1
    assert (
        "main thread: blocked in a collective (torch.distributed.distributed_c10d.all_reduce), waiting for the "
        "other ranks in the update of step 2" in rank0
    )
    assert "main thread: at " in rank1 and "in _maybe_stall" in rank1
    assert "train_step  [thread MainThread]" in rank1
    for section in (rank0, rank1):
        assert "Thread MainThread" in section and "Thread core-rl-watchdog" in section
    assert re.search(r"line \d+, in all_reduce", rank0) and "time.sleep(3600)" in rank1


def _steps(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"step"' in line)
    except OSError:
        return 0


def _wait(what: str, check, proc: subprocess.Popen, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) while waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"waited {timeout} s for {what}")


def _server_pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


@pytest.mark.server_env("vllm")
def test_a_request_to_a_paused_vllm_server(tmp_path: Path) -> None:
    """The vLLM example on a tiny model; after two steps its server process is paused (SIGSTOP):
    the next requests never come back (their own timeout is 600 s). Within the watchdog's 20 s
    the run ends with one line naming the phase (the next step's rollout; its weight sync if the
    rollout had finished before the pause) and the request in flight to that server's URL."""
    pytest.importorskip("core_rl_vllm")
    pytest.importorskip("core_rl_fsdp")
    sys.path.insert(0, str(ROOT / "examples" / "tiny_grpo"))
    try:
        from task import LETTERS, write_dataset
    finally:
        sys.path.remove(str(ROOT / "examples" / "tiny_grpo"))
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", alphabet=LETTERS + "=", seed=0, num_heads=2)
    data = write_dataset(tmp_path / "data" / "train.jsonl")
    run = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "core_rl.cli", "train", str(VLLM_EXAMPLE)),
        f"experiment.output_dir={tmp_path}",
        "experiment.name=run",
        f"actor.model_path={model}",
        f"data.train_files=[{data}]",
        "trainer.total_steps=500",
        "trainer.watchdog.timeout_s=20",
        "rollout.sampling.max_new_tokens=32",  # generation takes most of a step: the pause lands in one
        "saver.every_n_steps=0",
        "saver.at_end=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = preloaded.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        pid = _wait("the server to start", lambda: _server_pid(run / "servers" / "vllm-0.pid"), proc)
        _wait("two steps", lambda: _steps(run / "metrics.jsonl") >= 2, proc)
        pids = [pid, *session_members(pid)]
        os.kill(pid, signal.SIGSTOP)
        paused = time.monotonic()
        _, err = proc.communicate(timeout=180)
        took = time.monotonic() - paused
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err[-3000:]
    assert took < 20 + 30, took
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("core-rl: error: ")]
    port = re.search(r"vllm server vllm-0 \(http://127\.0\.0\.1:(\d+)\)|POST http://127\.0\.0\.1:(\d+)/", line)
    assert port, line
    phase = re.search(r"rank 0 is stuck in (rollout|sync) of step (\d+)", line)
    assert phase and int(phase.group(2)) >= 3, line
    if phase.group(1) == "rollout":
        assert "vllm server vllm-0 (http://127.0.0.1:" in line and "generation request" in line
    hang = _hang_file(run)
    assert line.endswith(f"Every thread's stack on every rank: {hang}")
    text = hang.read_text()
    assert f"phase: {phase.group(1)} of step {phase.group(2)}" in text
    assert "calls in flight (oldest first):" in text and "Thread vllm-rollout" in text
    deadline = time.monotonic() + 30  # the server's supervisor stops it once the trainer is gone
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)], "server processes left behind"
