"""The preallocated KV cache (``core_rl_hf.kv_cache``): the same keys/values as transformers'
concatenating cache, so generation gives the same tokens and log-probs with and without it."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from pathlib import Path

import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl_hf import decode
from core_rl_hf.engine import HFRolloutEngine
from core_rl_hf.kv_cache import PreallocatedLayer, cache_argument, output_cache, preallocate

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


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("decoder", ["transformers", "auto"])
def test_generation_uses_the_installed_name_of_the_cache(tiny_model_path: Path, decoder: str) -> None:
    """No deprecation notice from transformers: the cache is passed and read under the name the
    installed release's forward takes (``cache`` where it has it, ``past_key_values`` before)."""
    from core_rl_hf.config import HFRolloutConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    has_cache = "cache" in inspect.signature(model.forward).parameters
    assert cache_argument(model) == ("cache" if has_cache else "past_key_values")
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process: this test's own
    records = _Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        engine = HFRolloutEngine(tiny_model_path, HFRolloutConfig(seed=3, decoder=decoder))
        out = engine.generate([[1, 5, 6, 7], [1, 8, 9]], SamplingParams(n=2, max_new_tokens=6, min_new_tokens=6))
        engine.close()
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert all(len(s.response_ids) == 6 for group in out for s in group)
    assert [m for m in records.messages if "deprecated" in m] == []


def test_the_cache_is_read_from_either_field() -> None:
    @dataclasses.dataclass
    class Renamed:
        cache: object

    @dataclasses.dataclass
    class Older:
        past_key_values: object

    assert output_cache(Renamed(cache="c")) == "c"
    assert output_cache(Older(past_key_values="p")) == "p"

    class OlderForward(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return None

    assert cache_argument(OlderForward()) == "past_key_values"
