"""``pause("abort")`` interrupts a running batch: its unfinished samples continue after
``resume`` from the tokens they had, under the weights loaded meanwhile, and their per-token
versions change exactly at the interruption point."""

from __future__ import annotations

import asyncio
import threading

import core_rl_hf.engine as engine_module
import pytest
import torch
from core_rl.interfaces import SamplingParams

SAMPLING = SamplingParams(n=2, max_new_tokens=12, min_new_tokens=12)


def interrupt_at(monkeypatch, engine, token: int, new_state) -> list[threading.Thread]:
    """Make the engine's first batch be interrupted before token ``token``: a second thread pauses
    (abort), loads ``new_state`` as version 1 and resumes, as a trainer would."""
    real = engine_module.generate_batch
    updaters: list[threading.Thread] = []

    def update() -> None:
        engine.pause("abort")
        engine.update_weights(new_state, 1)
        engine.resume()

    def patched(*args, interrupted=None, **kwargs):
        if updaters:  # only the first batch is interrupted
            return real(*args, interrupted=interrupted, **kwargs)
        calls = {"n": 0}

        def check() -> bool:
            calls["n"] += 1
            if calls["n"] == token:  # checked before tokens 1, 2, ...: interrupt before `token`
                updaters.append(threading.Thread(target=update))
                updaters[0].start()
                for _ in range(1000):
                    if engine._abort.is_set():
                        break
                    threading.Event().wait(0.01)
            return interrupted()

        return real(*args, interrupted=check, **kwargs)

    monkeypatch.setattr(engine_module, "generate_batch", patched)
    return updaters


@pytest.mark.parametrize(
    ("call", "graphs"), [("generate", False), ("agenerate", False), ("generate", True), ("agenerate", True)]
)
def test_abort_continues_under_the_new_weights(
    make_engine, tiny_state_dict, next_token_logits, monkeypatch, call, graphs
) -> None:
    """``graphs``: the CUDA graph path with the capture replaced by the eager step (on a CPU): the
    continuation (the same rows, fewer tokens left) replays the graph the batch captured."""
    engine = make_engine(seed=0)
    if graphs:
        from core_rl_hf.graphs import DecodeGraphs, GraphedDecoder

        monkeypatch.setattr(GraphedDecoder, "_capture", lambda self: type("Eager", (), {"replay": self._advance})())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
        engine.graphs = DecodeGraphs()
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in tiny_state_dict.items()}
    updaters = interrupt_at(monkeypatch, engine, 5, new_state)
    prompt = [1, 10, 11]
    if call == "generate":
        (group,) = engine.generate([prompt], SAMPLING)
    else:
        group = asyncio.run(engine.agenerate(prompt, SAMPLING))
    updaters[0].join(30)
    assert engine.weight_version == 1
    for sample in group:
        assert len(sample.response_ids) == 12 and len(sample.logprobs) == 12
        assert sample.versions == [0] * 5 + [1] * 7
        assert sample.weight_version == 0 and sample.newest_version == 1
        assert sample.finish_reason == "length"
    # the last token before the interruption was sampled from the old weights, the first after it
    # from the new ones (log-probs recomputed by a plain forward pass)
    sample = group[0]
    tokens = sample.response_ids
    before = torch.log_softmax(next_token_logits(prompt + tokens[:4]), -1)[tokens[4]]
    after = torch.log_softmax(next_token_logits(prompt + tokens[:5], new_state), -1)[tokens[5]]
    assert sample.logprobs[4] == pytest.approx(float(before), abs=1e-4)
    assert sample.logprobs[5] == pytest.approx(float(after), abs=1e-4)
    if graphs:
        assert engine.graphs.captures == 1
