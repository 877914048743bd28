"""Shared fixtures; keep the tiny-model tests light on a shared 2-core machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Llama with its char tokenizer (see ``core_rl.testing.tiny``)."""
    from core_rl.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def torchrun() -> Callable[..., None]:
    """``torchrun(script, nproc, *args, cpu=True)``: :func:`core_rl.testing.launch.run_torchrun`."""
    from core_rl.testing.launch import run_torchrun

    def run(script: Path, nproc: int, *args: str, timeout: float = 240, cpu: bool = True) -> None:
        run_torchrun(script, nproc, *args, timeout=timeout, cpu=cpu)

    return run
