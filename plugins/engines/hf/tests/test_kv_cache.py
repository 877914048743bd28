"""The preallocated KV cache (``core_rl_hf.kv_cache``): the same keys/values as transformers'
concatenating cache, so generation gives the same tokens and log-probs with and without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl_hf import decode
from core_rl_hf.engine import HFRolloutEngine
from core_rl_hf.kv_cache import PreallocatedLayer, preallocate

pytestmark = pytest.mark.skipif(PreallocatedLayer is None, reason="transformers without per-layer caches")


def test_layer_writes_in_place_grows_and_selects_rows() -> None:
    from transformers.cache_utils import DynamicCache

    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, 2, n, 4, generator=g) for n in (5, 1, 1, 2)]
    plain, fast = DynamicCache(), preallocate(DynamicCache(), 6)
    for cache in (plain, fast):
        cache.update(steps[0], -steps[0], 0)
    preallocate(fast, 6)  # initialised layers only: the first update made it one
    assert type(fast.layers[0]) is PreallocatedLayer
    buffer = fast.layers[0].key_buffer
    for i, states in enumerate(steps[1:]):
        if i == 1:  # drop a row, as generation does with finished rows
            for cache in (plain, fast):
                cache.reorder_cache(torch.tensor([0, 2]))
        k1, v1 = plain.update(states[: plain.layers[0].keys.shape[0]], -states[: plain.layers[0].keys.shape[0]], 0)
        k2, v2 = fast.update(states[: fast.layers[0].keys.shape[0]], -states[: fast.layers[0].keys.shape[0]], 0)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert fast.get_seq_length() == plain.get_seq_length() == 9
    assert fast.layers[0].key_buffer.shape[-2] >= 9 and fast.layers[0].key_buffer is not buffer  # grew past 6


def test_generation_is_unchanged_by_the_preallocated_cache(tiny_model_path: Path, monkeypatch) -> None:
    from core_rl_hf.config import HFRolloutConfig

    prompts = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13]]
    sampling = SamplingParams(n=3, max_new_tokens=12, min_new_tokens=2)
    results = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(decode, "preallocate", lambda cache, capacity: cache)
        engine = HFRolloutEngine(tiny_model_path, HFRolloutConfig(seed=3, decoder="transformers"))
        out = engine.generate(prompts, sampling)
        results.append([(s.response_ids, s.logprobs, s.finish_reason) for group in out for s in group])
        engine.close()
    assert results[0] == results[1]
