"""The hf engine giving back its GPU memory while the trainer trains (``rollout.sleep_while_training``;
skipped without CUDA): releasing drops the captured decoding graphs with their key/value buffers
and returns the blocks to the device; the next generation captures them again and samples the same
greedy tokens. Not yet run: the machines this was written on have no GPU."""

from __future__ import annotations

from pathlib import Path

import torch
from core_rl.interfaces import SamplingParams
from core_rl.testing.sleep import gpu_marks
from core_rl.testing.tiny import build_tiny_model
from core_rl_hf.config import HFRolloutConfig
from core_rl_hf.engine import HFRolloutEngine

pytestmark = gpu_marks()


def test_release_drops_the_graphs_and_generation_captures_them_again(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", alphabet="abcd=")
    engine = HFRolloutEngine(model, HFRolloutConfig(device="cuda", dtype="bfloat16", cuda_graphs=True))
    try:
        greedy = SamplingParams(n=4, max_new_tokens=32, greedy=True)
        prompts = [[1, 5, 6, 7], [1, 8, 4]]  # "abcd=": ids 4..8 besides the 4 special ones
        before = engine.generate(prompts, greedy)
        assert engine.graphs is not None and engine.graphs.captures >= 1
        reserved = torch.cuda.memory_reserved()
        engine.release_memory()
        assert torch.cuda.memory_reserved() < reserved  # the graphs' pools and buffers went back
        captures = engine.graphs.captures
        engine.restore_memory()
        after = engine.generate(prompts, greedy)
        assert engine.graphs.captures > captures  # captured again
    finally:
        engine.close()
    assert [[s.response_ids for s in g] for g in after] == [[s.response_ids for s in g] for g in before]
