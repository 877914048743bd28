"""Launching a test worker script under ``torchrun`` (CPU, gloo), for multi-process tests.

A test that means CPU ranks says so with :func:`cpu_ranks_env`: on a GPU machine every rank
would otherwise pick ``cuda:LOCAL_RANK`` and NCCL, and two ranks need two GPUs. A test of real
GPU ranks is a separate test, skipped where the GPUs it needs are absent."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from core_rl.testing import preloaded

LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_ranks_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with every CUDA device hidden, so the
    processes started with it run on the CPU with gloo, whatever the machine has."""
    return {**(os.environ if env is None else env), "CUDA_VISIBLE_DEVICES": ""}


def run_torchrun(
    script: Path | str, nproc: int, *args: str, timeout: float = 240, cpu: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``script ARGS`` under ``python -m torch.distributed.run --standalone`` (a free local port
    of its own choosing) with ``nproc`` processes, one thread each, without the caller's own launch
    variables: CPU processes (:func:`cpu_ranks_env`), or with ``cpu=False`` one GPU each. Raise
    ``AssertionError`` with the tail of its output if it fails, ``subprocess.TimeoutExpired`` after
    ``timeout`` s. The agent's log folders (:func:`elastic_logs`) are removed when it ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if cpu:
        env = cpu_ranks_env(env)
    for key in LAUNCH_ENV_KEYS:
        env.pop(key, None)
    with elastic_logs() as logs:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--log-dir={logs}",
            str(script),
            *args,
        ]
        proc = preloaded.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def run_script(script: Path | str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``python SCRIPT ARGS`` in this interpreter with one torch thread (an example's ``main.py``,
    say); raise ``AssertionError`` with the tail of its output unless it exits 0,
    ``subprocess.TimeoutExpired`` after ``timeout`` s."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = preloaded.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def elastic_logs() -> tempfile.TemporaryDirectory[str]:
    """A folder for torch's elastic agent's logs (``torchrun --log-dir``), removed when the context
    exits. Without one the agent makes ``torchelastic_*`` under the system's temporary directory at
    every launch and never removes it."""
    return tempfile.TemporaryDirectory(prefix="core-rl-torchrun-", ignore_cleanup_errors=True)


def train_command(config: Path | str, *overrides: str, nproc: int = 0, log_dir: Path | str | None = None) -> list[str]:
    """The command of ``core-rl train CONFIG OVERRIDES`` in this interpreter; with ``nproc > 0`` under
    ``python -m torch.distributed.run`` with that many processes on a free local port, its logs in
    ``log_dir`` (default: a folder of the agent's own making, left behind; see :func:`elastic_logs`)."""
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        launcher += [f"--log-dir={log_dir}"] if log_dir is not None else []
    return [*launcher, "-m", "core_rl.cli", "train", str(config), *overrides]


def run_train(
    config: Path | str,
    *overrides: str,
    nproc: int = 0,
    expect: int = 0,
    timeout: float = 600,
    cpu: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run :func:`train_command` with one torch thread (on the CPU alone with ``cpu``, see
    :func:`cpu_ranks_env`); raise ``AssertionError`` with the tail of its output unless it exits
    with ``expect``, ``subprocess.TimeoutExpired`` after ``timeout`` s. Under torchrun, the agent's
    log folders (:func:`elastic_logs`) are removed when it ends."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cpu:
        env = cpu_ranks_env(env)
    with elastic_logs() as logs:
        command = train_command(config, *overrides, nproc=nproc, log_dir=logs if nproc else None)
        proc = preloaded.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, (
        f"core-rl train exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def write_grpo_config(tmp_path: Path, model: Path | str, train_files: list[str], **sections: object) -> Path:
    """``tmp_path/run.yaml``: the smallest GRPO run (fsdp, hf, exact_match; 2 prompts x 2 samples
    of at most 4 tokens, output under ``tmp_path/runs``) on ``model`` and ``train_files``, with
    ``sections`` replacing whole sections."""
    import yaml

    config = {
        "experiment": {"name": "run", "output_dir": str(tmp_path / "runs")},
        "data": {"train_files": list(train_files), "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match"},
        **sections,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
