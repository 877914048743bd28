"""SGLang giving back its memory while the trainer trains, on a GPU (``rollout.sleep_while_training``;
skipped without CUDA, or without the sglang server environment where it cannot be built): a server
started with ``--enable-memory-saver`` frees the GPU memory it holds when released and generates
the same greedy tokens after taking it back and reloading its weights
(:func:`core_rl.testing.sleep.check_sleep_round_trip`). Not yet run: the machines this was
written on have no GPU."""

from __future__ import annotations

from pathlib import Path

import torch
from core_rl.config.loader import structure
from core_rl.testing.sleep import check_sleep_round_trip, gpu_marks
from core_rl.testing.tiny import build_tiny_model
from core_rl_sglang.config import SGLangConfig
from core_rl_sglang.engine import SGLangRolloutEngine

pytestmark = gpu_marks("sglang")

#: the share of the GPU the server takes (the trainer shares the GPU)
MEM_FRACTION = 0.3


def test_a_released_server_gives_back_its_memory_and_generates_after_resuming(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", alphabet="abcd=", num_heads=2)
    options = {"dtype": "bfloat16", "mem_fraction_static": MEM_FRACTION, "server": {"env_variant": "cuda"}}
    engine = SGLangRolloutEngine(model, structure(options, SGLangConfig, path="rollout.engine"), tmp_path, sleep=True)
    try:
        check_sleep_round_trip(engine, model, MEM_FRACTION * torch.cuda.get_device_properties(0).total_memory)
    finally:
        engine.close()
