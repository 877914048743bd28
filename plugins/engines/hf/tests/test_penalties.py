"""Repetition, frequency and presence penalties in the ``hf`` engine: the formula on hand-made
logits and against the contract's second formulation, where they sit in a step (before
temperature and the filters; the reported log-prob ignores them), the per-row record the decoding
state keeps, and a sample continued after ``pause("abort")`` penalised as if never interrupted.
The end-to-end behaviour on a tiny model is the rollout contract's
(:mod:`core_rl.testing.penalty_contracts`)."""

from __future__ import annotations

import asyncio

import attrs
import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl.testing.penalty_contracts import penalised
from core_rl_hf.decode_state import DecodeState
from core_rl_hf.sampling import apply_penalties, check_sampling, choose_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from .test_interrupt import interrupt_at


def test_penalties_on_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, -0.5]])
    seen = torch.tensor([[True, True, False, True, False]])
    counts = torch.tensor([[2.0, 0.0, 0.0, 1.0, 0.0]])
    sampling = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # 0: 2 / 2 - 0.5 * 2 - 0.25; 1: -1 * 2; 2: unseen; 3: 0 stays 0, - 0.5 - 0.25; 4: unseen
    want = torch.tensor([[-0.25, -2.0, 0.5, -0.75, -0.5]])
    torch.testing.assert_close(apply_penalties(logits, seen, counts, sampling), want)
    assert apply_penalties(logits, seen, counts, SamplingParams()) is logits


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 7), min_size=1, max_size=5),
    response=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    repetition=st.floats(0.1, 2.0),
    frequency=st.floats(-2.0, 2.0),
    presence=st.floats(-2.0, 2.0),
    seed=st.integers(0, 2**16),
)
def test_penalties_match_the_contracts_formulation(prompt, response, repetition, frequency, presence, seed) -> None:
    """The decoding state's tensors, fed the response token by token, give the penalised logits
    of :func:`core_rl.testing.penalty_contracts.penalised` (plain sets and counts) at every step."""
    sampling = SamplingParams(repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence)
    logits = torch.randn(len(response), 8, generator=torch.Generator().manual_seed(seed))
    state = DecodeState(1, len(response), 8, sampling, stop_ids=[], pad_token_id=0, device=torch.device("cpu"))
    if state.seen is None:  # all neutral: the state keeps no record, the logits stay
        torch.testing.assert_close(penalised(logits, prompt, response, sampling), logits)
        return
    ids = torch.tensor([prompt])
    state.load_context(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids, dtype=torch.bool))
    got = []
    for t, token in enumerate(response):
        got.append(apply_penalties(logits[t : t + 1], state.seen, state.counts, sampling)[0])
        state.seen[0, token] = True  # what choose() records for the chosen token
        state.counts[0, token] += 1
    torch.testing.assert_close(torch.stack(got), penalised(logits, prompt, response, sampling))


def test_greedy_chooses_by_the_penalised_logits_and_reports_the_models_logprob() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    penalised_logits = torch.tensor([[0.5, 1.0, 0.0]])
    for sampling in (SamplingParams(greedy=True), SamplingParams(top_k=1, temperature=0.5)):
        tokens, logprobs = choose_tokens(logits, sampling, penalised=penalised_logits)
        assert tokens.tolist() == [1]
        scale = 1.0 if sampling.greedy else 0.5
        assert logprobs.item() == pytest.approx(torch.log_softmax(logits / scale, -1)[0, 1].item())


def test_penalties_apply_before_temperature() -> None:
    """z = [1, 0], token 0 generated once, frequency penalty 0.8, temperature 0.5: the scores are
    (z - 0.8 * c) / T = [0.4, 0], a ratio of e^-0.4 = 0.67 between the two tokens, which min-p
    0.5 keeps both of; penalising after temperature (z / T - 0.8 c = [1.2, 0]: e^-1.2 = 0.30)
    would keep token 0 only."""
    state = DecodeState(
        1, 1, 2, SamplingParams(frequency_penalty=0.8), stop_ids=[], pad_token_id=0, device=torch.device("cpu")
    )
    state.counts[0, 0] = 1.0
    pen = apply_penalties(torch.tensor([[1.0, 0.0]]), state.seen, state.counts, state.sampling)
    sampling = SamplingParams(temperature=0.5, min_p=0.5, frequency_penalty=0.8)
    gen = torch.Generator().manual_seed(0)
    seen = {
        choose_tokens(torch.tensor([[1.0, 0.0]]), sampling, penalised=pen, generator=gen)[0].item() for _ in range(60)
    }
    assert seen == {0, 1}


def test_context_counts_real_prompt_tokens_and_a_continued_response() -> None:
    """Left-padded rows: padding (id 0 here, also a real token of row 0) is not a token of the
    context; the last tokens marked generated count for frequency and presence."""
    sampling = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)
    state = DecodeState(2, 4, 6, sampling, stop_ids=[5], pad_token_id=0, device=torch.device("cpu"))
    tokens = torch.tensor([[1, 0, 3, 3], [0, 0, 2, 4]])
    real = torch.tensor([[True, True, True, True], [False, False, True, True]])
    generated = torch.tensor([[False, False, True, True], [False, False, False, True]])
    state.load_context(tokens, real, generated)
    assert state.seen.tolist() == [[True, True, False, True, False, False], [False, False, True, False, True, False]]
    assert state.counts.tolist() == [[0, 0, 0, 2, 0, 0], [0, 0, 0, 0, 1, 0]]
    state.choose(torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0], [0.0, 9.0, 0.0, 0.0, 0.0, 0.0]]))
    assert state.seen[:, [5, 1]].tolist() == [[True, True], [False, True]]
    assert state.counts[:, [5, 1]].tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_check_sampling_rejects_penalties_out_of_range() -> None:
    for params, fragment in (
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (SamplingParams(frequency_penalty=2.5), "frequency_penalty must be in"),
        (SamplingParams(presence_penalty=-2.5), "presence_penalty must be in"),
    ):
        with pytest.raises(ValueError, match=fragment):
            check_sampling(params)


@pytest.mark.parametrize(("call", "graphs"), [("generate", False), ("agenerate", False), ("generate", True)])
def test_a_continued_sample_is_penalised_as_if_never_interrupted(
    make_engine, tiny_state_dict, monkeypatch, call, graphs
) -> None:
    """Greedy with a frequency penalty, interrupted before token 5 (the same weights loaded back):
    the continuation counts the first 5 tokens as generated, so the response is the one an
    uninterrupted run gives (it differs where they were counted as prompt: checked). ``graphs``:
    the CUDA graph path with the capture replaced by the eager step (on a CPU), whose kept state
    the continuation loads its context into."""
    sampling = SamplingParams(n=1, max_new_tokens=12, min_new_tokens=12, greedy=True, frequency_penalty=0.3)
    prompt = [1, 10, 11]
    engine = make_engine(seed=0)
    if graphs:
        from core_rl_hf.graphs import DecodeGraphs, GraphedDecoder

        monkeypatch.setattr(GraphedDecoder, "_capture", lambda self: type("Eager", (), {"replay": self._advance})())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
        engine.graphs = DecodeGraphs()
    (want,) = engine.generate([prompt], sampling)
    updaters = interrupt_at(monkeypatch, engine, 5, tiny_state_dict)
    (got,) = (
        engine.generate([prompt], sampling) if call == "generate" else [asyncio.run(engine.agenerate(prompt, sampling))]
    )
    updaters[0].join(30)
    assert got[0].versions == [0] * 5 + [1] * 7
    assert got[0].response_ids == want[0].response_ids
    # the continuation alone, with its first 5 tokens taken for prompt: another response
    rest = engine.generate(
        [prompt + want[0].response_ids[:5]], attrs.evolve(sampling, max_new_tokens=7, min_new_tokens=7)
    )
    assert want[0].response_ids[:5] + rest[0][0].response_ids != want[0].response_ids
    if graphs:
        assert engine.graphs.captures == 1
