"""Two ranks under ``core-rl train --nproc-per-node 2`` (torch's elastic agent, gloo on CPU):
every listening socket is on 127.0.0.1; SIGTERM to the launcher makes every rank save and stop;
a SIGSTOPped rank makes the other fail within ``trainer.collective_timeout_s`` naming what it
waited for; a failure on rank 0 alone reaches rank 1, which stops with the same message; SIGTERM
while a rank is stuck inside its step stops both ranks within ``trainer.stop_grace_s``, without
saving, and the run resumes from its newest checkpoint."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from core_rl.reliability.progress import STALL_MARKER_VARIABLE, STALL_VARIABLE
from core_rl.testing import preloaded
from core_rl.testing.faults import finish, wait_for_file, wait_for_steps, worker_of_rank
from core_rl.testing.launch import cpu_ranks_env
from core_rl.testing.processes import process_tree
from core_rl_server_kit.processes import pid_alive
from fault_helpers import build_task, cli_command, cli_env, merged, run_dir, stable_metrics, write_config

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")


#: workers started by the launcher itself, found in its process tree (not forked from the test's
#: preloaded interpreter: core_rl/testing/preloaded.py)
FRESH_WORKERS = {"CORE_RL_TEST_PRELOAD": "0"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    config = build_task(tmp_path_factory.mktemp("dist"))
    return merged(config, trainer={"total_steps": 8}, saver={"every_n_steps": 4, "keep_last": 2})


def launch(config: dict, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    path = write_config(
        config, Path(config["experiment"]["output_dir"]).parent / f"{config['experiment']['name']}.yaml"
    )
    return preloaded.Popen(
        cli_command("train", "--nproc-per-node", "2", str(path), *overrides),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cpu_ranks_env({**cli_env(), **(env or {})}),  # CPU ranks (gloo), whatever the machine
        start_new_session=True,  # so cleanup can end the launcher and its workers together
    )


def listening_addresses(pids: list[int]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses of the TCP sockets in LISTEN state that ``pids`` hold (from /proc)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():  # no IPv6
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])  # 32-bit words in host (little-endian) order
                found.append(ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))
    return found


def is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_loopback_only_and_sigterm_saves_on_every_rank_then_resume(base):
    config = merged(base, experiment={"name": "sigterm"}, recover={"mode": "auto"})
    run = run_dir(config)
    proc = launch(config, env=FRESH_WORKERS)
    try:
        assert wait_for_steps(run, proc), finish(proc, 60)[-4000:]
        addresses = listening_addresses(process_tree(proc.pid))
        assert addresses, "the launcher and its workers listen on nothing?"
        assert all(is_loopback(a) for a in addresses), addresses
        proc.send_signal(signal.SIGTERM)
    finally:
        err = finish(proc, 240)
    assert proc.returncode == 3, err[-4000:]
    assert "core-rl: stopped by SIGTERM: every rank was asked to finish its step" in err
    last = max(stable_metrics(run))
    assert f"stopped by SIGTERM after step {last} of 8" in err
    assert (run / "checkpoints" / "latest").read_text() == f"step_{last:08d}"
    proc = launch(config)
    err = finish(proc, 300)
    assert proc.returncode == 0, err[-4000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{last:08d}'}" in err
    assert sorted(stable_metrics(run)) == list(range(1, 9))


def test_a_stopped_rank_makes_the_other_fail_within_the_timeout(base):
    config = merged(base, experiment={"name": "sigstop"}, trainer={"collective_timeout_s": 15})
    proc = launch(config, env=FRESH_WORKERS)
    try:
        assert wait_for_steps(run_dir(config), proc), finish(proc, 60)[-4000:]
        rank0, rank1 = worker_of_rank(proc.pid, 0), worker_of_rank(proc.pid, 1)
        assert rank0 is not None and rank1 is not None
        os.kill(rank1, signal.SIGSTOP)
        # once rank 0 has given up, rank 1 runs on, so it takes the agent's SIGTERM at once (stopped,
        # it would hold the run's end for torch's fixed 30 s grace before SIGKILL)
        assert ended(rank0, within=120), "rank 0 still runs 120 s after rank 1 was stopped"
        os.kill(rank1, signal.SIGCONT)
    finally:
        err = finish(proc, 180)
    assert proc.returncode == 1, err[-4000:]
    assert re.search(r"rank 0: waited more than 15 s for the other ranks (in|to) ", err), err[-4000:]
    assert "another rank is stopped, hung or dead" in err
    assert "core-rl: error: rank 0 exited with status 1" in err


def ended(pid: int, within: float) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie not yet reaped) within ``within`` s."""
    deadline = time.monotonic() + within
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_failure_on_rank_0_alone_reaches_rank_1(base):
    """Rank 0 alone starts the loggers; its jsonl logger cannot open its file (a file stands where
    its directory should be), which the checks before the run cannot know. Rank 1 must stop with
    rank 0's message long before the 600 s collective timeout."""
    config = merged(
        base,
        experiment={"name": "rank0"},
        trainer={"collective_timeout_s": 600},
        loggers=[{"name": "jsonl", "filename": "blocked/metrics.jsonl"}],
    )
    run = run_dir(config)
    run.mkdir(parents=True)
    (run / "blocked").write_text("a file where the logger wants a directory")
    proc = launch(config)
    err = finish(proc, 240)
    assert proc.returncode == 1, err[-4000:]
    assert re.search(r"core_rl/builtin/loggers\.py\", line \d+, in start", err), err[-4000:]  # rank 0's traceback
    assert re.search(r"core-rl: error: rank 0 failed: .*blocked", err), err[-4000:]  # rank 1's message


def test_sigterm_while_a_rank_is_stuck_stops_every_rank_within_the_grace(base):
    """Rank 1 sleeps inside its ``train_step`` of step 6; rank 0 waits for it in a native gloo
    collective, where Python's own signal handler never runs. SIGTERM to the launcher after step 5:
    both ranks stop ``trainer.stop_grace_s`` (5 s) later without saving, rank 0 saying where it
    was stuck and which checkpoint stays (step 4's); the launcher exits with 128 + 15 saying the
    ranks did not save. Launched again, the run resumes from step 4 and finishes."""
    config = merged(base, experiment={"name": "stuck"}, recover={"mode": "auto"}, trainer={"stop_grace_s": 5})
    run = run_dir(config)
    stuck = Path(config["experiment"]["output_dir"]).parent / "stuck.stalled"
    proc = launch(config, env={STALL_VARIABLE: "1:6:train_step", STALL_MARKER_VARIABLE: str(stuck)})
    try:
        assert wait_for_steps(run, proc, 5), finish(proc, 60)[-4000:]
        # rank 1 inside step 6's train_step (after step 5's stop check)
        assert wait_for_file(stuck, proc), finish(proc, 60)[-4000:]
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        err = finish(proc, 120)
    finally:
        finish(proc, 1)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    assert took < 5 + 20, took
    assert "Traceback" not in err
    kept = run / "checkpoints" / "step_00000004"
    assert (
        "core-rl: the current step did not finish within trainer.stop_grace_s (5 s) of SIGTERM: stopping without "
        "saving (stuck in update of step 6, in train engine 'fsdp'" in err
    ), err[-4000:]
    assert f"The newest complete checkpoint is {kept}, as it was" in err
    assert (
        "core-rl: stopped by SIGTERM: ranks 0, 1 did not finish the step within trainer.stop_grace_s and stopped "
        "without saving" in err
    )
    assert (run / "checkpoints" / "latest").read_text() == kept.name
    proc = launch(config)
    err = finish(proc, 300)
    assert proc.returncode == 0, err[-4000:]
    assert f"resumed from {kept} (step 4)" in err
    assert sorted(stable_metrics(run)) == list(range(1, 9))
