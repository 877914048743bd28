"""Launching a test worker script under ``torchrun`` (CPU, gloo), for multi-process tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: Path | str, nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``script ARGS`` under ``python -m torch.distributed.run`` with ``nproc`` processes on a free
    local port, one thread each, without the caller's own launch variables; raise ``AssertionError``
    with the tail of its output if it fails, ``subprocess.TimeoutExpired`` after ``timeout`` s."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in LAUNCH_ENV_KEYS:
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def train_command(config: Path | str, *overrides: str, nproc: int = 0) -> list[str]:
    """The command of ``core-rl train CONFIG OVERRIDES`` in this interpreter; with ``nproc > 0`` under
    ``python -m torch.distributed.run`` with that many processes on a free local port."""
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    return [*launcher, "-m", "core_rl.cli", "train", str(config), *overrides]


def run_train(
    config: Path | str, *overrides: str, nproc: int = 0, expect: int = 0, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run :func:`train_command` with one torch thread; raise ``AssertionError`` with the tail of its
    output unless it exits with ``expect``, ``subprocess.TimeoutExpired`` after ``timeout`` s."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        train_command(config, *overrides, nproc=nproc), env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == expect, (
        f"core-rl train exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc
