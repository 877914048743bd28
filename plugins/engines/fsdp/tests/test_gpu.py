"""CUDA + NCCL with bf16 mixed precision (skipped without a GPU): run in a fresh ``torchrun``
process so the NCCL group is the engine's own."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_nccl_bf16_train_resume_export(tiny_model: Path, tmp_path: Path, torchrun: Callable[..., None]) -> None:
    nproc = min(2, torch.cuda.device_count())
    torchrun(
        Path(__file__).with_name("gpu_train.py"), nproc, "--model", str(tiny_model), "--out", str(tmp_path), cpu=False
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == nproc and result["device"] == "cuda"
    assert result["lp_error"] < 0.05  # bf16 compute vs an fp32 reference
    losses = result["losses"]
    assert losses[-1] < losses[0]
    assert result["resumed_losses"] == pytest.approx(losses[2:], rel=1e-4)
    assert result["resume_weight_diff"] < 1e-4
