"""Shared algorithm math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.ops import aggregation_weights, group_mean_std, kl_estimate, masked_mean

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # lengths 2 and 3, N = 2
LOSS = torch.tensor([[1.0, 3.0, 100.0], [2.0, 4.0, 6.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 3 + 2 + 4 + 6) / 5),  # 3.2
        ("seq-mean-token-mean", ((1 + 3) / 2 + (2 + 4 + 6) / 3) / 2),  # (2 + 4) / 2 = 3
        ("seq-mean-token-sum", ((1 + 3) + (2 + 4 + 6)) / 2),  # 8
        ("seq-mean-token-sum-norm", ((1 + 3) + (2 + 4 + 6)) / (2 * 3)),  # 16 / 6
    ],
)
def test_aggregation_hand_values(mode, expected):
    w = aggregation_weights(MASK, mode)
    assert (w * LOSS).sum().item() == pytest.approx(expected)
    assert (w[MASK == 0] == 0).all()


def test_aggregation_is_split_invariant_and_norm_length():
    w = aggregation_weights(MASK, "seq-mean-token-sum-norm", norm_length=4)
    assert (w * LOSS).sum().item() == pytest.approx(16 / 8)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        w = aggregation_weights(MASK, mode)
        whole = (w * LOSS).sum()
        parts = (w[:1] * LOSS[:1]).sum() + (w[1:] * LOSS[1:]).sum()
        assert torch.isclose(whole, parts)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregation_weights(MASK, "mean")


def test_kl_estimators_hand_values():
    lp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([-0.5, -1.0])  # d = 0.5, 0
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.0])
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, 0.0])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_k3_is_non_negative_and_k1_unbiased_in_expectation():
    torch.manual_seed(0)
    p = torch.distributions.Categorical(logits=torch.randn(6))
    q = torch.distributions.Categorical(logits=torch.randn(6))
    x = p.sample((200_000,))
    exact = torch.distributions.kl_divergence(p, q).item()
    d_lp, d_ref = p.log_prob(x), q.log_prob(x)
    assert (kl_estimate(d_lp, d_ref, "k3") >= -1e-7).all()
    assert kl_estimate(d_lp, d_ref, "k1").mean().item() == pytest.approx(exact, abs=0.02)
    assert kl_estimate(d_lp, d_ref, "k3").mean().item() == pytest.approx(exact, abs=0.02)


def test_group_mean_std():
    values = torch.tensor([1.0, 3.0, 5.0, 2.0])
    groups = torch.tensor([7, 7, 7, 9])
    mean, std, count = group_mean_std(values, groups)
    assert mean.tolist() == [3.0, 3.0, 3.0, 2.0]
    assert std.tolist() == pytest.approx([2.0, 2.0, 2.0, 0.0])  # unbiased std of 1,3,5 is 2
    assert count.tolist() == [3.0, 3.0, 3.0, 1.0]


def test_masked_mean():
    assert masked_mean(LOSS, MASK).item() == pytest.approx(3.2)
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0
