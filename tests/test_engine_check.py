"""The engines' GPU workers share :mod:`core_rl.testing.engine_check`; here it runs for real on CPU
(fsdp, 2 ranks under torchrun with gloo), so the shared check cannot rot where no GPU runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from core_rl.testing.launch import run_torchrun

pytest.importorskip("core_rl_fsdp")

WORKER = """
from core_rl.testing.engine_check import worker_main
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.engine import FSDPEngine

worker_main(lambda actor: FSDPEngine(actor, FSDPConfig(), trainable=True), "fsdp")
"""


def test_train_save_resume_export_on_two_cpu_ranks(tmp_path: Path) -> None:
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_torchrun(script, 2, "--model", str(model), "--out", str(tmp_path), timeout=300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == 2 and result["device"] == "cpu"
    assert result["lp_error"] < 1e-4  # float32 on both sides
    losses = result["losses"]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert result["resumed_losses"] == pytest.approx(losses[2:], rel=1e-6)
    assert result["resume_weight_diff"] < 1e-6
    assert result["export_dtypes"] == ["torch.float32"]
