"""Generation behaviour of the ``hf`` engine on the tiny model: left padding, stop rules, sampling
distributions, seeding and chunking."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl.testing.contracts import hf_logprobs
from core_rl_hf.engine import HFRolloutEngine, plan_chunks

EOS = 2
# prompts of very different lengths, so batching them needs a lot of left padding
PROMPTS = [[1], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 20, 21], [1, 30, 31, 32, 33, 34]]

MakeEngine = Callable[..., HFRolloutEngine]


def _ids(engine: HFRolloutEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    return [[s.response_ids for s in samples] for samples in engine.generate(prompts, params)]


def _greedy_alone(engine: HFRolloutEngine, params: SamplingParams):
    return [engine.generate([p], params)[0][0] for p in PROMPTS]


def test_left_padded_batch_equals_one_prompt_at_a_time(make_engine: MakeEngine, any_model_path: Path) -> None:
    engine = make_engine(any_model_path)
    params = SamplingParams(n=2, max_new_tokens=8, greedy=True)
    batched = engine.generate(PROMPTS, params)
    alone = _greedy_alone(engine, params)
    for samples, single in zip(batched, alone):
        for s in samples:
            assert s.response_ids == single.response_ids
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(single.logprobs), atol=1e-5, rtol=0)


def test_left_padded_batch_with_rows_finishing_at_different_steps(make_engine: MakeEngine) -> None:
    engine = make_engine()
    free = _greedy_alone(engine, SamplingParams(max_new_tokens=8, greedy=True))
    # a stop token that some row generates mid-response and a row running to the length limit never does
    long = next(f.response_ids for f in free if f.finish_reason == "length")
    stop = next(t for f in free for t in f.response_ids[1:] if t not in long and t != EOS)
    params = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=[stop])
    batched = [samples[0] for samples in engine.generate(PROMPTS, params)]
    alone = _greedy_alone(engine, params)
    reasons = {s.finish_reason for s in batched}
    assert reasons == {"stop", "length"}, "the fixture should make some rows stop early and others not"
    for b, a, f in zip(batched, alone, free):
        assert (b.response_ids, b.finish_reason) == (a.response_ids, a.finish_reason)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
        if b.finish_reason == "stop":
            cut = next(i for i, t in enumerate(f.response_ids) if t in (stop, EOS)) + 1
            assert b.response_ids == f.response_ids[:cut]
        else:
            assert b.response_ids == f.response_ids and stop not in b.response_ids


def test_sampled_logprobs_match_forward_under_left_padding(make_engine: MakeEngine, any_model_path: Path) -> None:
    engine = make_engine(any_model_path, seed=3)
    out = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=7, temperature=1.3, top_k=10, top_p=0.9))
    for samples in out:
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            want = hf_logprobs(any_model_path, ids, torch.ones_like(ids), 1.3)[0, len(s.prompt_ids) :]
            torch.testing.assert_close(torch.tensor(s.logprobs), want, atol=1e-4, rtol=0)


def test_samples_are_in_prompt_order_with_own_prompt_ids(make_engine: MakeEngine) -> None:
    engine = make_engine(max_batch_size=3)
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=2))
    assert [[s.prompt_ids for s in samples] for samples in out] == [[p, p] for p in PROMPTS]
    out[0][0].prompt_ids.append(99)
    assert out[0][1].prompt_ids == PROMPTS[0] and PROMPTS[0] == [1]


def test_tiny_top_p_and_top_k_one_equal_greedy(make_engine: MakeEngine) -> None:
    engine = make_engine(seed=0)
    greedy = engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=6, greedy=True))
    for params in (SamplingParams(n=3, max_new_tokens=6, top_p=1e-6), SamplingParams(n=3, max_new_tokens=6, top_k=1)):
        for g, samples in zip(greedy, engine.generate(PROMPTS, params)):
            for s in samples:
                assert s.response_ids == g[0].response_ids
                torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(g[0].logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("lengths", "n", "max_batch", "expected"),
    [
        ([3, 1, 2], 2, 4, [[(1, 2), (2, 2)], [(0, 2)]]),
        ([3, 1, 2], 2, 6, [[(1, 2), (2, 2), (0, 2)]]),
        ([5, 5], 5, 2, [[(0, 2)], [(0, 2)], [(0, 1), (1, 1)], [(1, 2)], [(1, 2)]]),
        ([4], 3, 256, [[(0, 3)]]),
    ],
)
def test_plan_chunks(lengths: list[int], n: int, max_batch: int, expected: list[list[tuple[int, int]]]) -> None:
    chunks = plan_chunks(lengths, n, max_batch)
    assert chunks == expected
    assert all(sum(c for _, c in chunk) <= max_batch for chunk in chunks)
    per_prompt = Counter()
    for chunk in chunks:
        for i, count in chunk:
            per_prompt[i] += count
    assert per_prompt == dict.fromkeys(range(len(lengths)), n)


def test_chunk_size_does_not_change_greedy_output(make_engine: MakeEngine) -> None:
    params = SamplingParams(n=3, max_new_tokens=6, greedy=True)
    assert _ids(make_engine(max_batch_size=1), PROMPTS, params) == _ids(make_engine(), PROMPTS, params)


# ---------------------------------------------------------------------------------------------
# stop tokens and EOS


def test_stop_token_ends_response_and_min_new_tokens_blocks_it(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = PROMPTS[1]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=8, greedy=True))[0][0].response_ids
    j = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    stop = free[j]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=[stop]))[0][0]
    assert out.response_ids == free[: j + 1] and out.finish_reason == "stop"

    blocked = engine.generate(
        [prompt], SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=[stop], min_new_tokens=j + 1)
    )[0][0]
    assert blocked.response_ids[:j] == free[:j]
    assert blocked.response_ids[j] != stop  # the greedy choice was blocked, the runner-up taken
    assert stop not in blocked.response_ids[: j + 1]
    if blocked.finish_reason == "stop":
        assert blocked.response_ids[-1] in (stop, EOS) and len(blocked.response_ids) > j + 1
    else:
        assert len(blocked.response_ids) == 8


def _eos_first(state_dict: dict[str, torch.Tensor], token: int) -> dict[str, torch.Tensor]:
    """Weights whose output rows for ``token`` and EOS are swapped: wherever the model would pick
    ``token`` it now picks EOS, with ``token``'s old logit."""
    new = dict(state_dict)
    head = state_dict["lm_head.weight"].clone()
    head[[token, EOS]] = head[[EOS, token]]
    new["lm_head.weight"] = head
    return new


def test_eos_stops_and_is_blocked_before_min_new_tokens(
    make_engine: MakeEngine, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    engine = make_engine()
    prompt = PROMPTS[2]
    first = engine.generate([prompt], SamplingParams(max_new_tokens=4, greedy=True))[0][0]
    assert first.response_ids[0] != EOS
    engine.update_weights(_eos_first(tiny_state_dict, first.response_ids[0]), version=1)

    out = engine.generate([prompt], SamplingParams(n=2, max_new_tokens=4, greedy=True))[0]
    for s in out:
        assert s.response_ids == [EOS] and s.finish_reason == "stop"
        assert abs(s.logprobs[0] - first.logprobs[0]) < 1e-5

    late = engine.generate([prompt], SamplingParams(max_new_tokens=4, greedy=True, min_new_tokens=3))[0][0]
    assert len(late.response_ids) >= 3 and EOS not in late.response_ids[:3]


def test_eos_ids_from_generation_config_list(make_engine: MakeEngine, tiny_model_path: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = make_engine().generate([PROMPTS[3]], SamplingParams(max_new_tokens=4, greedy=True))[0][0].response_ids[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.generation_config.eos_token_id = [EOS, first]
    model.save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "m")
    engine = make_engine(tmp_path / "m")
    assert engine.eos_token_ids == sorted({EOS, first})
    out = engine.generate([PROMPTS[3]], SamplingParams(max_new_tokens=4, greedy=True))[0][0]
    assert out.response_ids == [first] and out.finish_reason == "stop"


# ---------------------------------------------------------------------------------------------
# sampling distributions


def _sharpened(state_dict: dict[str, torch.Tensor], factor: float = 10.0) -> dict[str, torch.Tensor]:
    """Weights with the output layer scaled: a peaked next-token distribution (entropy ~2.7 nats
    at T=1 instead of ~3.8), so temperature changes it visibly."""
    return {**state_dict, "lm_head.weight": state_dict["lm_head.weight"] * factor}


def _first_token_frequencies(engine: HFRolloutEngine, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    out = engine.generate([prompt], params)[0]
    counts = Counter(s.response_ids[0] for s in out)
    freq = torch.zeros(engine.vocab_size)
    for token, count in counts.items():
        freq[token] = count / len(out)
    return freq


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


N_DRAWS = 20_000
TOLERANCE = 0.035  # expected total variation of 20k draws over ~40 tokens is about 0.02


@pytest.fixture
def sharp_engine(make_engine: MakeEngine, tiny_state_dict: dict[str, torch.Tensor]) -> HFRolloutEngine:
    engine = make_engine(seed=11, max_batch_size=N_DRAWS)
    engine.update_weights(_sharpened(tiny_state_dict), version=1)
    return engine


def test_temperature_sampling_follows_softmax(
    sharp_engine: HFRolloutEngine, next_token_logits, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    prompt = [1, 10, 11]
    logits = next_token_logits(prompt, _sharpened(tiny_state_dict))
    targets = {t: torch.softmax(logits / t, -1) for t in (0.5, 1.0, 2.0)}
    assert min(_tv(targets[a], targets[b]) for a in targets for b in targets if a != b) > 0.2
    for t, target in targets.items():
        freq = _first_token_frequencies(
            sharp_engine, prompt, SamplingParams(n=N_DRAWS, max_new_tokens=1, temperature=t)
        )
        assert _tv(freq, target) < TOLERANCE, t


def test_top_k_and_top_p_sample_the_renormalised_kept_set(
    sharp_engine: HFRolloutEngine, next_token_logits, tiny_state_dict: dict[str, torch.Tensor]
) -> None:
    prompt = [1, 20, 21, 22]
    probs = torch.softmax(next_token_logits(prompt, _sharpened(tiny_state_dict)) / 2.0, -1)
    order = probs.argsort(descending=True)
    cases = {"top_k": (SamplingParams(top_k=5), order[:5])}
    mass_before = probs[order].cumsum(0) - probs[order]
    cases["top_p"] = (SamplingParams(top_p=0.5), order[mass_before < 0.5])
    for name, (params, kept) in cases.items():
        assert 2 <= len(kept) < len(probs) // 2, name
        target = torch.zeros_like(probs)
        target[kept] = probs[kept] / probs[kept].sum()
        params.n, params.max_new_tokens, params.temperature = N_DRAWS, 1, 2.0
        freq = _first_token_frequencies(sharp_engine, prompt, params)
        assert freq[target == 0].sum() == 0, f"{name}: sampled a filtered token"
        assert _tv(freq, target) < TOLERANCE, name


# ---------------------------------------------------------------------------------------------
# seeding


def test_seed_makes_generation_reproducible(make_engine: MakeEngine) -> None:
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.5)
    a, b, c = make_engine(seed=7), make_engine(seed=7), make_engine(seed=8)
    first_a, first_b = _ids(a, PROMPTS, params), _ids(b, PROMPTS, params)
    assert first_a == first_b
    assert _ids(a, PROMPTS, params) == _ids(b, PROMPTS, params) != first_a  # the generator advances
    assert _ids(c, PROMPTS, params) != first_a


def test_without_seed_the_global_rng_is_used(make_engine: MakeEngine) -> None:
    engine = make_engine()
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.5)
    torch.manual_seed(5)
    first = _ids(engine, PROMPTS, params)
    torch.manual_seed(5)
    assert _ids(engine, PROMPTS, params) == first


# ---------------------------------------------------------------------------------------------
# errors


def test_bad_prompts_and_params_are_rejected(make_engine: MakeEngine) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 5], []], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, engine.vocab_size]], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([[1]], SamplingParams(temperature=0.0))


def test_closed_engine_refuses_to_generate(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1]], SamplingParams())


def test_bfloat16_weights_generate_close_logprobs(make_engine: MakeEngine, tiny_model_path: Path) -> None:
    engine = make_engine(dtype="bfloat16", seed=0)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    for samples in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5)):
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            want = hf_logprobs(tiny_model_path, ids, torch.ones_like(ids))[0, len(s.prompt_ids) :]
            torch.testing.assert_close(torch.tensor(s.logprobs), want, atol=0.05, rtol=0)


def test_stop_strings_end_decoding_early(make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy responses stopped at a stop string equal the free responses cut there; with every
    character a stop string, every row stops at its first token with text and decoding ends at the
    check that stops the last row (the host checks every token on a CPU), not at the budget."""
    import core_rl_hf.stop_check as stop_check
    from core_rl.rollout.stop_strings import stop_cut
    from core_rl.testing.tiny import DEFAULT_ALPHABET

    engine = make_engine()
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, greedy=True))
    decode = engine._decode_text
    stop = decode([free[1][0].response_ids[2]])  # the third token's text of the second prompt's answer
    cut = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, greedy=True, stop=[stop]))
    for (whole,), (got,) in zip(free, cut):
        keep = stop_cut(whole.response_ids, decode, [stop])
        assert got.response_ids == whole.response_ids[: keep or len(whole.response_ids)]
        assert got.finish_reason == ("stop" if keep else whole.finish_reason)
    checks: list[int] = []
    check = stop_check.StopStringCheck.__call__
    monkeypatch.setattr(
        stop_check.StopStringCheck, "__call__", lambda c, state, t: (checks.append(t), check(c, state, t))
    )
    every = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=12, stop=list(DEFAULT_ALPHABET)))
    lengths = [len(s.response_ids) for samples in every for s in samples]
    assert all(s.finish_reason == "stop" for samples in every for s in samples)
    assert max(lengths) < 4  # at the first token with text (special tokens have none)
    assert max(checks) == max(lengths)  # no token decoded after the check that stopped the last row
