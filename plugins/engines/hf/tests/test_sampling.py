"""Unit tests of one decoding step (:mod:`core_rl_hf.sampling`) on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.interfaces import SamplingParams
from core_rl_hf.sampling import (
    block_tokens,
    check_sampling,
    choose_tokens,
    min_p_filter,
    sample_rows,
    top_k_filter,
    top_p_filter,
)

NEG = float("-inf")


def test_block_tokens_copies_and_masks() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = block_tokens(logits, torch.tensor([True, False, True]))
    assert out.tolist() == [[NEG, 2.0, NEG]]
    assert logits.tolist() == [[1.0, 2.0, 3.0]]
    assert block_tokens(logits, None) is logits


def test_top_k_keeps_k_largest_and_ties() -> None:
    logits = torch.tensor([[0.0, 5.0, 3.0, 4.0], [1.0, 1.0, 1.0, 0.0]])
    assert top_k_filter(logits, 2).tolist() == [[NEG, 5.0, NEG, 4.0], [1.0, 1.0, 1.0, NEG]]
    assert top_k_filter(logits, 0) is logits
    assert top_k_filter(logits, 4) is logits


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = probs.log()
    # descending order 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, False]
    assert kept(0.51) == [False, True, False, True]
    assert kept(0.81) == [True, True, False, True]
    assert kept(1e-9) == [False, True, False, False]
    assert top_p_filter(logits, 1.0) is logits


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely() -> None:
    probs = torch.tensor([[0.15, 0.4, 0.05, 0.21, 0.19]])
    logits = probs.log()
    # threshold min_p * 0.4: 0.5 -> 0.2, 0.3 -> 0.12, 0.6 -> 0.24
    kept = lambda m: torch.isfinite(min_p_filter(logits, m))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, True, False]
    assert kept(0.3) == [True, True, False, True, True]
    assert kept(0.6) == [False, True, False, False, False]
    assert kept(0.999) == [False, True, False, False, False]
    assert min_p_filter(logits, 0.0) is logits
    # the kept logits are unchanged: sampling renormalises over them
    assert min_p_filter(logits, 0.5)[0, 1].item() == logits[0, 1].item()


def test_min_p_applies_after_temperature_and_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0]])
    gen = torch.Generator().manual_seed(0)
    # temperature 0.5: q = softmax([4, 2, 0, -10]) ~ [0.867, 0.117, 0.016, 0]; min_p 0.1 keeps {0, 1}
    seen = set()
    for _ in range(200):
        tokens, lps = choose_tokens(logits, SamplingParams(temperature=0.5, min_p=0.1), generator=gen)
        seen.add(tokens.item())
        # the reported log-prob ignores the filter
        assert math.isclose(lps.item(), torch.log_softmax(logits / 0.5, -1)[0, tokens.item()].item(), abs_tol=1e-6)
    assert seen == {0, 1}
    # at temperature 2 the same min_p keeps token 2 too (q ~ [0.50, 0.30, 0.18, 0.01])
    params = SamplingParams(temperature=2.0, min_p=0.1)
    seen = {choose_tokens(logits, params, generator=gen)[0].item() for _ in range(300)}
    assert seen == {0, 1, 2}
    # top-p 0.6 keeps {0, 1}; then min-p 0.5 keeps both (0.30 >= 0.5 * 0.50), min-p 0.7 token 0 only
    for min_p, want in ((0.5, {0, 1}), (0.7, {0})):
        params = SamplingParams(temperature=2.0, top_p=0.6, min_p=min_p)
        assert {choose_tokens(logits, params, generator=gen)[0].item() for _ in range(100)} == want


def test_greedy_blocks_but_reports_unblocked_logprob() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    blocked = torch.tensor([True, False, False])
    tokens, lps = choose_tokens(logits, SamplingParams(greedy=True, temperature=0.3), blocked=blocked)
    assert tokens.tolist() == [1]
    assert math.isclose(lps.item(), torch.log_softmax(logits, -1)[0, 1].item(), abs_tol=1e-6)


def test_sampling_logprob_is_temperature_scaled_and_unfiltered() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=2, top_p=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens, lps = choose_tokens(logits, params, blocked=torch.tensor([True, False, False, False]), generator=gen)
        token = tokens.item()
        # token 0 is blocked; top-k 2 of the rest keeps {1, 2}; the reported log-prob ignores both filters
        assert token in (1, 2)
        assert math.isclose(lps.item(), torch.log_softmax(logits / 0.5, -1)[0, token].item(), abs_tol=1e-6)


def test_sampling_rows_are_independent() -> None:
    logits = torch.tensor([[10.0, -10.0], [-10.0, 10.0]]).repeat(50, 1)
    tokens, _ = choose_tokens(logits, SamplingParams(), generator=torch.Generator().manual_seed(1))
    assert tokens.tolist() == [0, 1] * 50


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (SamplingParams(n=0), "n must be >= 1"),
        (SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (SamplingParams(min_new_tokens=-1), "min_new_tokens"),
        (SamplingParams(temperature=0.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(min_p=1.0), "min_p"),
        (SamplingParams(min_p=-0.1), "min_p"),
    ],
)
def test_check_sampling_rejects(params: SamplingParams, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        check_sampling(params)


def test_check_sampling_accepts_greedy_with_zero_temperature() -> None:
    check_sampling(SamplingParams(greedy=True, temperature=0.0))


def test_sampled_rows_follow_the_distribution() -> None:
    """The inverse-CDF draw (one uniform per row) gives each token its probability: 40,000 rows of
    one distribution over a 49,152-entry vocabulary (most entries zero, as after top-k), each
    frequency within 5 standard deviations of its probability, and no zero-probability token."""
    vocab, rows = 49152, 40000
    probs = torch.zeros(vocab)
    probs[[0, 7, 1000, 49151, 30000]] = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    generator = torch.Generator().manual_seed(3)  # 1,000 rows a draw: a float64 CDF of 49,152 entries each
    tokens = torch.cat([sample_rows(probs.expand(1000, vocab), generator) for _ in range(rows // 1000)])
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * rows
    spread = (expected * (1 - probs.double())).sqrt()
    assert ((counts - expected).abs() <= 5 * spread + 1e-9).all(), counts[probs > 0]


def test_sampling_matches_a_reference_draw_in_distribution() -> None:
    """Against ``torch.multinomial`` on a random softmax over 64 tokens: the two empirical
    distributions of 50,000 draws each are within a total-variation distance noise allows."""
    probs = torch.softmax(torch.randn(64, generator=torch.Generator().manual_seed(0)) * 2, dim=-1)
    many = probs.expand(50000, 64)
    ours = torch.bincount(sample_rows(many, torch.Generator().manual_seed(1)), minlength=64).double() / 50000
    ref = torch.bincount(
        torch.multinomial(many, 1, generator=torch.Generator().manual_seed(2)).squeeze(-1), minlength=64
    )
    tv = 0.5 * (ours - ref.double() / 50000).abs().sum()
    assert tv < 0.02, tv
