"""The ``fsdp`` and ``deepspeed`` (ZeRO 2) engines train the tiny Qwen3-MoE with rollout routing
replay on 1 and on 2 ranks (torchrun, gloo on CPU): the same losses, MoE metrics (reduced over
ranks) and log-probs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from core_rl.testing.launch import run_torchrun
from core_rl.testing.tiny import build_tiny_model

WORKER = Path(__file__).with_name("moe_dist_worker.py")


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_two_ranks_train_the_moe_as_one(tmp_path: Path, engine: str) -> None:
    pytest.importorskip(f"core_rl_{engine}")
    model = build_tiny_model(tmp_path / "model", architecture="qwen3_moe", num_layers=2, seed=0)
    results = {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}"
        run_torchrun(WORKER, ranks, "--model", str(model), "--out", str(out), "--engine", engine, timeout=300)
        results[ranks] = json.loads((out / "result.json").read_text())
    one, two = results[1], results[2]
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    assert 0.0 < one["steps"][0]["moe/routing_agreement"] <= 1.0
    flat = lambda rows: [v for row in rows for v in row]  # noqa: E731
    assert flat(one["logprobs"]) == pytest.approx(flat(two["logprobs"]), abs=1e-4)
