"""The vocabulary-parallel log-prob and entropy formulas against the core's full-vocabulary
``token_logprobs`` (a second formulation), values and gradients, with padded vocabulary columns.
One rank here; ``test_distributed.py`` checks the same with the vocabulary split over 2 ranks."""

from __future__ import annotations

import pytest
import torch
from core_rl.engine_utils.logprobs import align_to_tokens, token_logprobs
from core_rl_megatron.vocab_parallel import vocab_parallel_stats


@pytest.mark.parametrize(("seed", "temperature", "padded"), [(0, 1.0, 0), (1, 0.6, 5), (2, 1.7, 3)])
def test_matches_full_vocabulary_softmax(seed: int, temperature: float, padded: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab = 29
    logits = torch.randn(3, 8, vocab + padded, generator=g, dtype=torch.float64).float() * 4
    ids = torch.randint(0, vocab, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[2, 6:] = 0
    w1, w2 = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)

    ref_in = logits[..., :vocab].clone().requires_grad_(True)
    ref_lp, ref_ent = token_logprobs(ref_in, ids, mask, temperature, with_entropy=True)
    ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()

    got_in = logits.clone().requires_grad_(True)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # position i scores token i + 1
    lp, ent = vocab_parallel_stats(
        got_in, targets, vocab_start=0, vocab_size=vocab, temperature=temperature, with_entropy=True
    )
    lp, ent = align_to_tokens(lp[:, :-1], mask), align_to_tokens(ent[:, :-1], mask)
    ((lp * w1).sum() + (ent * w2).sum()).backward()

    torch.testing.assert_close(lp, ref_lp, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=5e-6, rtol=0)
    torch.testing.assert_close(got_in.grad[..., :vocab], ref_in.grad, atol=1e-5, rtol=1e-5)
    assert not got_in.grad[..., vocab:].any(), "padded vocabulary columns must get no gradient"
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


def test_hand_computed_two_token_vocabulary() -> None:
    """Logits (0, ln 3): p = (1/4, 3/4); log p(1) = ln 0.75; H = -(0.25 ln 0.25 + 0.75 ln 0.75)."""
    logits = torch.tensor([[[0.0, float(torch.log(torch.tensor(3.0)))]]])
    lp, ent = vocab_parallel_stats(logits, torch.tensor([[1]]), vocab_start=0, vocab_size=2, with_entropy=True)
    assert lp.item() == pytest.approx(torch.log(torch.tensor(0.75)).item(), abs=1e-6)
    expected = -(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75))).item()
    assert ent.item() == pytest.approx(expected, abs=1e-6)


def test_rejects_non_positive_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_stats(
            torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), vocab_start=0, vocab_size=2, temperature=0
        )


def test_entropy_without_gradient() -> None:
    """``entropy_grad=False``: the same values, an entropy without gradient, and the log-prob's
    gradient unchanged."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    out = {}
    for grad in (True, False):
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_stats(x, targets, vocab_start=0, vocab_size=11, with_entropy=True, entropy_grad=grad)
        assert ent.requires_grad is grad
        lp.sum().backward()
        out[grad] = (lp.detach(), ent.detach(), x.grad)
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)
