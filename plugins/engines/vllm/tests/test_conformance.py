"""The core conformance kit run against real vLLM servers started from the managed ``vllm``
server environment (built on first use: ``core-rl server-env create vllm``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

import attrs
import core_rl_vllm.plugin
import pytest
from core_rl.interfaces import SamplingParams
from core_rl.testing import ServerRolloutEngineContract, installed_distribution
from core_rl_server_kit.remote import ServerReplyError
from core_rl_vllm.engine import BATCH_ROUTE, GENERATE_PATH


class TestVLLMRolloutEngine(ServerRolloutEngineContract):
    plugin = core_rl_vllm.plugin
    name = "vllm"
    distribution = installed_distribution("core-rl-vllm")
    options: ClassVar[dict[str, Any]] = {"dtype": "bfloat16", "max_num_seqs": 64}
    # vLLM's CPU attention: head size >= 32; 2048 positions: room for the long request below
    tiny_model_options: ClassVar[dict[str, Any]] = {"num_heads": 2, "max_position_embeddings": 2048}
    forks_on_cpu = True
    logprob_atol = 2e-2
    min_p_logprobs_renormalised = True  # --logprobs-mode processed_logprobs (core_rl_vllm.engine)
    penalty_logprobs_penalised = True  # the same: penalties are part of the processed logits

    @pytest.fixture
    def together(self, engine, monkeypatch):
        """The engine with a batch window wide enough that two requests sent from a test's event
        loop (another thread, which may wait a GIL switch interval of 5 ms between them) always
        share a batch: the tests below are about what the server does with a batch."""
        monkeypatch.setattr(engine, "options", attrs.evolve(engine.options, batch_window_s=0.25))

    def test_requests_that_arrive_together_share_one_round_trip(self, engine) -> None:
        """A generation batch reaches the server as one ``POST /core_rl/generate`` (the server's
        access log), each prompt still answered with its own samples."""
        (log,) = engine.server_logs().values()
        before = log.read_text()
        prompts = [[1, 10 + i, 11, 12] for i in range(8)]
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, min_new_tokens=4))
        assert [len(g) for g in out] == [2] * 8
        assert all(s.prompt_ids == p and len(s.response_ids) == 4 for p, g in zip(prompts, out) for s in g)
        new = log.read_text()[len(before) :]
        assert new.count(f"POST {BATCH_ROUTE} ") == 1 and new.count(f"POST {GENERATE_PATH} ") == 0

    @pytest.mark.usefixtures("together")
    def test_a_batched_request_comes_back_as_soon_as_it_finishes(self, engine) -> None:
        """The batch route streams each request's answer when it finishes: a 1-token request sent
        with a 1000-token one is answered while the long one still has 999 engine steps to go. An
        answer sent once the whole batch finished resolves both from one reply, a thread switch
        (<= 5 ms) apart. 999 steps of the tiny model take ~1.1 s on a 2-core host; one CI run
        answered a 200-token request only 36 ms after a 1-token one (~180 ms at 1000 tokens)."""
        (log,) = engine.server_logs().values()
        before = len(log.read_text())

        async def both() -> tuple[bool, float]:
            long = asyncio.ensure_future(
                engine.agenerate([1, 10, 11, 12], SamplingParams(n=1, max_new_tokens=1000, min_new_tokens=1000))
            )
            await engine.agenerate([1, 11, 11, 12], SamplingParams(n=1, max_new_tokens=1, min_new_tokens=1))
            short_done = time.perf_counter()
            long_pending = not long.done()
            await long
            return long_pending, time.perf_counter() - short_done

        long_pending, gap = asyncio.run(both())
        assert long_pending and gap > 0.05, f"the short request waited for the long one (answered {gap:.4f} s apart)"
        assert log.read_text()[before:].count(f"POST {BATCH_ROUTE} ") == 1

    @pytest.mark.usefixtures("together")
    def test_a_bad_request_in_a_batch_fails_alone(self, engine) -> None:
        """A request the server refuses (a token id outside the vocabulary) fails with the
        server's status and is not retried; the request batched with it is answered."""
        (log,) = engine.server_logs().values()
        before = len(log.read_text())

        async def both() -> tuple[list, BaseException | None]:
            good = asyncio.ensure_future(engine.agenerate([1, 10, 11, 12], SamplingParams(n=2, max_new_tokens=3)))
            bad = asyncio.ensure_future(engine.agenerate([1, 10**6], SamplingParams(n=2, max_new_tokens=3)))
            done = await asyncio.gather(good, bad, return_exceptions=True)
            return done[0], done[1]

        good, bad = asyncio.run(both())
        assert len(good) == 2 and all(len(s.response_ids) > 0 for s in good)
        assert isinstance(bad, ServerReplyError) and 400 <= bad.status < 500, bad
        assert log.read_text()[before:].count(f"POST {BATCH_ROUTE} ") == 1  # not retried
