"""A real one-node Slurm cluster on this machine for a test: ``munged``, ``slurmctld`` and ``slurmd``
from Debian's packages (``slurmctld slurmd slurm-client munge``), each in the foreground as a child
of the test, with their own key, configuration, ports, state and logs under a temporary directory.
The node is named ``localhost`` (``slurmd -N``), so a job's node list, and everything the job
starts, is on 127.0.0.1. Where the packages are not installed, or not as root (``slurmd`` must be),
:func:`missing` says why and the test skips."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from core_rl.testing.launch import free_port

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
#: how long the daemons may take until the node is idle (a loaded 2-core machine)
START_TIMEOUT_S = 90


def missing() -> str | None:
    """Why a local Slurm cannot run here, or ``None``."""
    absent = [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing; Debian: apt-get install slurmctld slurmd munge)"
    if os.geteuid() != 0:
        return "a local slurmd must run as root"
    return None


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _config(root: Path, cpus: int) -> str:
    return "\n".join(
        [
            "ClusterName=corerltest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge.sock'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            "PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@contextmanager
def local_slurm(root: Path, cpus: int = 2) -> Iterator[dict[str, str]]:
    """Start the cluster under ``root``; yields the environment variables its commands need
    (``SLURM_CONF``). Every daemon is stopped afterwards, and every job cancelled first."""
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    subprocess.run([_program("mungekey"), "-c", "-f", "-k", str(key)], check=True, capture_output=True)
    key.chmod(0o600)
    conf = root / "slurm.conf"
    conf.write_text(_config(root, cpus))
    env = {"SLURM_CONF": str(conf)}
    full = {**os.environ, **env}
    logs = root / "log"
    commands = [
        [
            _program("munged"), "-F", "-f", f"--socket={root / 'munge.sock'}", f"--key-file={key}",
            f"--pid-file={root / 'munged.pid'}", f"--log-file={logs / 'munged.log'}",
            f"--seed-file={root / 'munge.seed'}",
        ],
        [_program("slurmctld"), "-D", "-f", str(conf), "-L", str(logs / "slurmctld.log")],
        [_program("slurmd"), "-D", "-N", "localhost", "-f", str(conf), "-L", str(logs / "slurmd.log")],
    ]  # fmt: skip
    daemons: list[subprocess.Popen] = []
    try:
        for command in commands:
            with open(logs / f"{Path(command[0]).name}.out", "ab") as out:  # the daemon keeps its own copy
                daemons.append(subprocess.Popen(command, env=full, stdout=out, stderr=subprocess.STDOUT))
            if command[0].endswith("munged"):
                _wait_for(lambda: (root / "munge.sock").exists(), "munged's socket", logs)
        _wait_for(lambda: _node_idle(full), "the Slurm node localhost to be idle (sinfo)", logs)
        yield env
    finally:
        subprocess.run([_program("scancel"), "--full", "-u", "root"], env=full, capture_output=True, timeout=30)
        for proc in reversed(daemons):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _node_idle(env: dict[str, str]) -> bool:
    proc = subprocess.run(
        [_program("sinfo"), "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30
    )
    return proc.returncode == 0 and proc.stdout.strip() == "idle"


def _wait_for(ready: Callable[[], bool], what: str, logs: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            tails = "\n".join(f"{p.name}: {p.read_text(errors='replace')[-800:]}" for p in sorted(logs.iterdir()))
            raise TimeoutError(f"local Slurm: waited {START_TIMEOUT_S} s for {what}; logs:\n{tails}")
        time.sleep(0.5)


def wait_for_job(job: str, env: dict[str, str], timeout: float) -> str:
    """Wait at most ``timeout`` s for job ``job`` to end; its final ``JobState``."""
    full = {**os.environ, **env}
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        proc = subprocess.run(
            [_program("scontrol"), "show", "job", job], env=full, capture_output=True, text=True, timeout=30
        )
        words = dict(w.split("=", 1) for w in proc.stdout.split() if "=" in w)
        state = words.get("JobState", state)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN"):
            return state
        time.sleep(1.0)
    raise TimeoutError(f"Slurm job {job} did not end within {timeout:g} s (last state {state})")
