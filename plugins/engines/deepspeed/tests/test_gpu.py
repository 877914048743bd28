"""CUDA + NCCL, ZeRO-3 with bf16 and optimizer offload, and ZeRO-2 with float16's dynamic loss
scale through a checkpoint (skipped without a GPU), each in a fresh ``torchrun`` process so the
NCCL group is the engine's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core_rl.testing.launch import run_torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_nccl_zero3_bf16_offload_train_resume_export(tiny_model: Path, tmp_path: Path) -> None:
    nproc = min(2, torch.cuda.device_count())
    script = Path(__file__).with_name("gpu_train.py")
    run_torchrun(script, nproc, "--model", str(tiny_model), "--out", str(tmp_path), timeout=600, cpu=False)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == nproc
    assert result["lp_error"] < 0.05  # bf16 compute vs an fp32 reference
    losses = result["losses"]
    assert losses[-1] < losses[0]
    assert result["resumed_losses"] == pytest.approx(losses[2:], rel=1e-3)
    assert result["resume_weight_diff"] < 1e-3
    assert result["export_dtypes"] == ["torch.float32"]  # the fp32 master weights, not the bf16 copies


def test_float16_loss_scale_survives_a_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    script = Path(__file__).with_name("fp16_resume.py")
    run_torchrun(script, 1, "--model", str(tiny_model), "--out", str(tmp_path), timeout=600, cpu=False)
    result = json.loads((tmp_path / "fp16.json").read_text())
    assert result["scale_saved"] < result["initial_scale"]  # the overflowing steps lowered it
    assert result["scale_loaded"] == result["scale_saved"]
    assert result["resumed_after"] == pytest.approx(result["after"], rel=1e-3)
    assert result["scales_after"][0] == result["scales_after"][1]
