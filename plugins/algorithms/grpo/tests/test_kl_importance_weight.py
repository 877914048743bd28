"""``ppo_clip``'s ``kl_importance_weight``: the KL penalty times the importance ratio, in the graph
(DeepSeek-V3.2's unbiased reverse-KL gradient; TRL's ``use_bias_correction_kl``). Hand values on
policy, parity with a second formulation (the per-token formula written out) under hypothesis at
token level, the sequence level's weight, and the configuration check."""

from __future__ import annotations

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.ops.kl import KL_CAP
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl_grpo.config import PPOClipConfig
from core_rl_grpo.losses import PPOClipLoss
from hypothesis import given, settings
from hypothesis import strategies as st


def make_loss(**options: object) -> PPOClipLoss:
    return PPOClipLoss(structure(options, PPOClipConfig, path="algorithm.loss"))


def kl_only(batch: TensorBatch) -> TensorBatch:
    """The batch with zero advantages: the surrogate and its gradient vanish, the KL term is left."""
    return TensorBatch({**batch, "advantages": torch.zeros_like(batch["advantages"])})


def per_token_grad(loss: PPOClipLoss, batch: TensorBatch, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp = lp.detach().clone().requires_grad_(True)
    out = loss(batch, lp, torch.zeros_like(lp)).per_token_loss
    out.sum().backward()
    return out.detach(), lp.grad


def test_on_policy_the_value_is_the_plain_kl_and_the_gradient_gains_the_kl_itself() -> None:
    """At ratio 1: l = beta * k3, and d/dlp [exp(lp - old) * k3(lp)] = k3 + dk3/dlp, where
    k3 = exp(ref - lp) - (ref - lp) - 1 and dk3/dlp = 1 - exp(ref - lp)."""
    beta = 0.5
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    batch = TensorBatch(
        {
            "response_mask": torch.ones(1, 2),
            "loss_mask": torch.ones(1, 2),
            "advantages": torch.zeros(1, 2),
            "old_logprobs": lp.clone(),
            "ref_logprobs": ref,
        }
    )
    plain_value, plain_grad = per_token_grad(make_loss(kl_coef=beta), batch, lp)
    value, grad = per_token_grad(make_loss(kl_coef=beta, kl_importance_weight=True), batch, lp)
    k3 = torch.exp(ref - lp) - (ref - lp) - 1
    dk3 = 1 - torch.exp(ref - lp)
    torch.testing.assert_close(value, beta * k3)
    torch.testing.assert_close(value, plain_value)
    torch.testing.assert_close(plain_grad, beta * dk3)
    torch.testing.assert_close(grad, beta * (k3 + dk3))


@given(seed=st.integers(0, 10_000), scale=st.floats(0.0, 1.0), estimator=st.sampled_from(["k1", "k2", "k3"]))
@settings(max_examples=25, deadline=None)
def test_token_level_equals_the_weighted_formula(seed: int, scale: float, estimator: str) -> None:
    """Off policy, the per-token loss and its gradient equal ``beta * exp(lp - old) * KL_est(lp, ref)``
    written out per estimator (k1 = lp - ref, k2 = (lp - ref)^2 / 2, k3 as above; each clamped to
    +-KL_CAP, where the gradient is 0)."""
    beta = 0.2
    batch = kl_only(make_rl_batch(seed=seed))
    mask = batch["response_mask"]
    g = torch.Generator().manual_seed(seed)
    lp = (batch["old_logprobs"] + scale * torch.randn(mask.shape, generator=g)) * mask
    value, grad = per_token_grad(make_loss(kl_coef=beta, kl_estimator=estimator, kl_importance_weight=True), batch, lp)

    x = lp.detach().clone().requires_grad_(True)
    d = batch["ref_logprobs"] - x
    kl = {"k1": -d, "k2": d**2 / 2, "k3": torch.exp(d) - d - 1}[estimator].clamp(-KL_CAP, KL_CAP)
    expected = beta * torch.exp(x - batch["old_logprobs"]) * kl * mask
    expected.sum().backward()
    torch.testing.assert_close(value, expected.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad * mask, x.grad * mask, atol=1e-6, rtol=1e-5)


def test_sequence_level_weighs_each_token_by_its_sequence_ratio() -> None:
    """At ``sequence`` level the weight's value is the GSPO sequence ratio s_i on every token."""
    batch = kl_only(make_rl_batch(seed=3))
    mask = batch["response_mask"]
    lp = (batch["old_logprobs"] + 0.2 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))) * mask
    options = {"kl_coef": 0.3, "importance_sampling_level": "sequence"}
    plain, _ = per_token_grad(make_loss(**options), batch, lp)
    weighted, _ = per_token_grad(make_loss(**options, kl_importance_weight=True), batch, lp)
    s = torch.exp(((lp - batch["old_logprobs"]) * mask).sum(-1) / mask.sum(-1))
    torch.testing.assert_close(weighted, plain * s[:, None], atol=1e-6, rtol=1e-5)


def test_it_needs_a_kl_coefficient() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.loss\.kl_importance_weight: .*needs kl_coef > 0"):
        make_loss(kl_importance_weight=True)
