"""``export_adapter`` (``rollout.lora_sync: adapter``) on 2 CPU ranks, for the ``fsdp`` and the
``deepspeed`` (ZeRO-3) engines: rank 0 writes the whole adapter, gathered from the ranks' shards,
the same as the adapter ``export_hf`` writes from the whole state dict, and the same as one rank's
after the same training on the same global batches (``tests/adapter_export_worker.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_deepspeed")

from core_rl.testing.launch import run_torchrun
from core_rl.testing.weight_transfer import assert_same_adapter

WORKER = Path(__file__).with_name("adapter_export_worker.py")
ENGINES = ("fsdp", "deepspeed")
# a different reduction order over 2 ranks moves the last bits of the update (measured: 2.5e-7)
ATOL = 1e-5


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    from core_rl.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("adapter-ranks")
    model = build_tiny_model(root / "model", seed=0)
    for ranks in (2, 1):
        run_torchrun(WORKER, ranks, "--model", str(model), "--out", str(root / f"ranks{ranks}"), timeout=300)
    return {ranks: root / f"ranks{ranks}" for ranks in (2, 1)}


@pytest.mark.parametrize("engine", ENGINES)
def test_two_ranks_write_the_whole_trained_adapter(exports: dict[int, Path], engine: str) -> None:
    from safetensors.torch import load_file

    two, one = exports[2] / engine, exports[1] / engine
    assert_same_adapter(two / "adapter", two / "export" / "adapter")
    config = json.loads((two / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    got, want = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (two, one))
    assert got.keys() == want.keys() and len(got) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], atol=ATOL, rtol=0, msg=key)
        if "lora_B" in key:  # zero at the start: trained
            assert value.abs().max() > 1e-4, key
