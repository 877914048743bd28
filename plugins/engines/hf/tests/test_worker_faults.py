"""The worker thread behind ``agenerate`` outlives a fault in its own batching: the requests of
that batch get the error, and later requests are served (no caller waits without end)."""

from __future__ import annotations

import asyncio

import core_rl_hf.engine as engine_module
import pytest
from core_rl.interfaces import SamplingParams

# min_new_tokens: the tiny model may sample EOS first, and the check is that both tokens come back
SAMPLING = SamplingParams(n=1, max_new_tokens=2, min_new_tokens=2)


def test_a_batching_fault_reaches_the_callers_and_the_worker_lives_on(make_engine, monkeypatch) -> None:
    engine = make_engine()
    real = engine_module.batch_key

    def broken(sampling):
        raise RuntimeError("injected batching fault")

    monkeypatch.setattr(engine_module, "batch_key", broken)

    async def ask():
        return await asyncio.wait_for(engine.agenerate([1, 2, 3], SAMPLING), timeout=60)

    with pytest.raises(RuntimeError, match="injected batching fault"):
        asyncio.run(ask())
    monkeypatch.setattr(engine_module, "batch_key", real)
    (sample,) = asyncio.run(ask())
    assert len(sample.response_ids) == 2
