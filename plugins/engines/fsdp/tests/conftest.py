"""Shared fixtures; keep the tiny-model tests light on a shared 2-core machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Llama with its char tokenizer (see ``core_rl.tiny``)."""
    from core_rl.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def torchrun() -> Callable[..., None]:
    """``torchrun(script, nproc, *args)``: run ``script`` under ``python -m torch.distributed.run``
    with ``nproc`` processes on a free local port (one thread each); fail with its output if it fails."""

    def run(script: Path, nproc: int, *args: str, timeout: float = 240) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}",
            str(script),
            *args,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"

    return run
