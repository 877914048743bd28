"""``ppo_clip``'s ``positive_nll_coef``: an NLL (SFT) term on the tokens with a positive advantage,
aggregated by the loss's own weights. Hand values, its gradient is exactly the NLL's restricted to
those tokens (for every aggregation, under hypothesis), off is bitwise the loss without it, the
token metric, and a negative coefficient is a configuration error naming the key."""

from __future__ import annotations

import core_rl_grpo.plugin as grpo_plugin
import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.ops.names import AGGREGATIONS
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import POLICY_LOSS
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from hypothesis import given, settings
from hypothesis import strategies as st


def make_loss(**options: object):
    host = PluginHost(entry_points=[])
    host.register_plugin(grpo_plugin, distribution="core-rl-grpo")
    entry = host.get(POLICY_LOSS, "ppo_clip")
    return entry.factory(structure(options, entry.config_cls, path="algorithm.loss"))


def total(loss, batch: TensorBatch, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict]:
    out = loss(batch, logprobs, torch.zeros_like(logprobs))
    weights = loss.loss_weights(batch["response_mask"])
    return (out.per_token_loss * weights).sum(), out.token_metrics


def test_hand_values_token_mean() -> None:
    # two rows on-policy (ratio 1, so the PPO term is -A per token); row 0 A = +2 on 2 tokens with
    # log-probs -1, -3; row 1 A = -1 on its 1 token (log-prob -2). token-mean over 3 tokens:
    # PPO: (-2 - 2 + 1) / 3 = -1; NLL on the positive tokens only: 0.5 * (1 + 3) / 3 = 2/3
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    lp = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]], requires_grad=True)
    batch = TensorBatch(
        {
            "response_mask": mask,
            "old_logprobs": lp.detach().clone(),
            "advantages": torch.tensor([[2.0, 2.0], [-1.0, 0.0]]),
        }
    )
    value, metrics = total(make_loss(positive_nll_coef=0.5), batch, lp)
    assert float(value.detach()) == pytest.approx(-1.0 + 2.0 / 3.0)
    torch.testing.assert_close(metrics["positive_nll"], torch.tensor([[1.0, 3.0], [0.0, 0.0]]))
    value.backward()
    # d/d lp: PPO -A/3 per token; NLL -0.5/3 on the positive tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 / 3 - 0.5 / 3, -2 / 3 - 0.5 / 3], [1 / 3, 0.0]]))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(AGGREGATIONS), st.floats(0.01, 3.0), st.booleans())
def test_gradient_is_the_nll_gradient_on_positive_tokens(seed, aggregation, coef, decoupled) -> None:
    batch = make_rl_batch(seed=seed % 1000)
    options = {"aggregation": aggregation, "norm_length": 8, "use_decoupled_loss": decoupled, "entropy_coef": 0.01}
    g = torch.Generator().manual_seed(seed)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 1.0])[:, None]  # rows of both signs, and a zero one
    batch["advantages"] = signs * torch.rand(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    base = (batch["old_logprobs"] + 0.1 * torch.randn(batch["old_logprobs"].shape, generator=g)) * batch[
        "response_mask"
    ]
    grads = {}
    for c in (0.0, coef):
        lp = base.clone().requires_grad_(True)
        value, _ = total(make_loss(positive_nll_coef=c, **options), batch, lp)
        value.backward()
        grads[c] = lp.grad
    weights = make_loss(**options).loss_weights(batch["response_mask"])
    positive = (batch["advantages"] > 0).float() * batch["response_mask"]
    # d/d log pi_t of coef * sum w_t * (-log pi_t) * [A_t > 0]
    torch.testing.assert_close(grads[coef] - grads[0.0], -coef * weights * positive, rtol=1e-5, atol=1e-7)


def test_off_is_bitwise_unchanged_and_negative_is_refused() -> None:
    batch = make_rl_batch(seed=4)
    lp = (batch["old_logprobs"] + 0.05) * batch["response_mask"]
    for options in ({}, {"aggregation": "seq-mean-token-mean", "kl_coef": 0.1}):
        plain = make_loss(**options)(batch, lp, torch.zeros_like(lp))
        off = make_loss(positive_nll_coef=0.0, **options)(batch, lp, torch.zeros_like(lp))
        assert torch.equal(plain.per_token_loss, off.per_token_loss)
        assert "positive_nll" not in off.token_metrics
    with pytest.raises(ConfigError, match=r"algorithm\.loss\.positive_nll_coef: must be >= 0"):
        make_loss(positive_nll_coef=-0.1)
