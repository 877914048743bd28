"""GMPO (``algorithm.loss.use_gmpo_loss``): hand values, the gradient against a closed form written
here, the on-policy property, the configuration refusals, the default left as it was, and a real run
of examples/tiny_grpo with the option on. (Micro-batch invariance and parity with the ratio-space
reference formulation: test_loss_properties.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from core_rl import ops
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl_grpo.config import PPOClipConfig
from core_rl_grpo.losses import PPOClipLoss
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[4]
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def gmpo(**options: object) -> PPOClipLoss:
    return PPOClipLoss(structure({"use_gmpo_loss": True, **options}, PPOClipConfig, path="algorithm.loss"))


def run(loss: PPOClipLoss, batch: TensorBatch, lp: torch.Tensor):
    """Per-token loss, metrics, aggregated loss and its gradient with respect to ``lp``."""
    lp = lp.detach().clone().requires_grad_(True)
    out = loss(batch, lp, torch.zeros_like(lp))
    total = (out.per_token_loss * loss.loss_weights(batch["loss_mask"])).sum()
    total.backward()
    return out, total.detach(), lp.grad


def two_sequences() -> tuple[TensorBatch, torch.Tensor]:
    """Sequence 0: A = +1, log-ratios (0.2, 0.6, -0.5); sequence 1: A = -2, log-ratios (0.5, -0.7), padded."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, 0.0]])
    log_ratio = torch.tensor([[0.2, 0.6, -0.5], [0.5, -0.7, 0.0]])
    adv = torch.tensor([[1.0], [-2.0]]) * mask
    batch = TensorBatch({"response_mask": mask, "loss_mask": mask, "old_logprobs": old, "advantages": adv})
    return batch, old + log_ratio


def test_hand_values_two_sequences() -> None:
    """eps 0.4 either side. Sequence 0 (A > 0): 0.6 is clipped to 0.4, -0.5 stays (below the range
    is the pessimistic side); sequence 1 (A < 0): -0.7 is clipped to -0.4, 0.5 stays."""
    batch, lp = two_sequences()
    g0, g1 = math.exp((0.2 + 0.4 - 0.5) / 3), math.exp((0.5 - 0.4) / 2)
    l0, l1 = -1.0 * g0, 2.0 * g1
    out, total, grad = run(gmpo(aggregation="seq-mean-token-mean"), batch, lp)
    torch.testing.assert_close(out.per_token_loss.detach(), torch.tensor([[l0, l0, l0], [l1, l1, 0.0]]))
    torch.testing.assert_close(out.token_metrics["clipped"], torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    torch.testing.assert_close(total, torch.tensor((l0 + l1) / 2))
    # d L_i / d log pi_t = -A_i g_i / |y_i| on unclipped tokens, times the sequence's weight 1/N = 1/2
    torch.testing.assert_close(grad, torch.tensor([[-g0 / 6, 0.0, -g0 / 6], [g1 / 2, 0.0, 0.0]]))
    _, total, grad = run(gmpo(), batch, lp)  # token-mean: each sequence weighs |y_i| / 5
    torch.testing.assert_close(total, torch.tensor((3 * l0 + 2 * l1) / 5))
    torch.testing.assert_close(grad, torch.tensor([[-g0 / 5, 0.0, -g0 / 5], [2 * g1 / 5, 0.0, 0.0]]))
    # asymmetric bounds (0.1 below, 0.5 above): 0.6 -> 0.5 and -0.5 kept; 0.5 kept and -0.7 -> -0.1
    out, _, _ = run(gmpo(gmpo_eps_low=0.1, gmpo_eps_high=0.5, aggregation="seq-mean-token-mean"), batch, lp)
    want = [-math.exp((0.2 + 0.5 - 0.5) / 3), 2.0 * math.exp((0.5 - 0.1) / 2)]
    torch.testing.assert_close(out.per_token_loss.detach()[:, 0], torch.tensor(want))


def closed_form(batch: TensorBatch, lp: torch.Tensor, weights: torch.Tensor, eps: float):
    """The aggregated loss and its gradient written out per sequence in ratio space:
    ``g = (prod_t rho'_t)^(1/L)`` with ``rho'_t = min(rho_t, clip(rho_t, e^-eps, e^eps))`` for A > 0
    (max for A < 0); the loss is ``sum_i W_i (-A_i g_i)`` with ``W_i`` the sequence's total
    aggregation weight, and ``d/d log pi_t = -W_i A_i g_i / L_i`` where ``rho'_t = rho_t``."""
    total, grad = 0.0, torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        tokens = [t for t in range(lp.shape[1]) if batch["loss_mask"][i, t] != 0]
        a = float(batch["advantages"][i, tokens[0]])
        product, free = 1.0, []
        for t in tokens:
            rho = math.exp(float(lp[i, t] - batch["old_logprobs"][i, t]))
            bounded = min(max(rho, math.exp(-eps)), math.exp(eps))
            kept = min(rho, bounded) if a > 0 else max(rho, bounded)
            product *= kept
            free.append(kept == rho or a == 0)
        g = product ** (1.0 / len(tokens))
        w = float(weights[i].sum())
        total += w * -a * g
        for t, is_free in zip(tokens, free, strict=True):
            grad[i, t] = -w * a * g / len(tokens) if is_free else 0.0
    return total, grad


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(AGGREGATIONS), st.sampled_from([0.1, 0.4]), st.sampled_from([0.0, 0.6]))
def test_gradient_matches_the_closed_form(seed: int, aggregation: str, eps: float, drift: float) -> None:
    batch = make_rl_batch(batch_size=5, max_response_len=6, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lp = batch["old_logprobs"] + torch.randn(batch["old_logprobs"].shape, generator=g) * drift * batch["loss_mask"]
    loss = gmpo(aggregation=aggregation, norm_length=6, gmpo_eps_low=eps, gmpo_eps_high=eps)
    _, total, grad = run(loss, batch, lp)
    want_total, want_grad = closed_form(batch, lp, loss.loss_weights(batch["loss_mask"]), eps)
    torch.testing.assert_close(total, torch.tensor(want_total), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(AGGREGATIONS))
def test_on_policy_it_is_the_policy_gradient_of_the_mean_log_prob(seed: int, aggregation: str) -> None:
    """All ratios 1: every sequence's loss is -A_i, and the gradient is that of
    ``sum_i W_i * (-A_i * mean_t log pi_t)`` (``W_i``: the sequence's aggregation weight)."""
    batch = make_rl_batch(batch_size=6, max_response_len=6, seed=seed)
    mask, adv = batch["loss_mask"], batch["advantages"]
    loss = gmpo(aggregation=aggregation, norm_length=6)
    out, _, grad = run(loss, batch, batch["old_logprobs"])
    torch.testing.assert_close(out.per_token_loss.detach(), -adv * mask)
    assert not out.token_metrics["clipped"].any()
    lp = batch["old_logprobs"].clone().requires_grad_(True)
    seq_weight = loss.loss_weights(mask).sum(dim=-1)
    mean_lp = (lp * mask).sum(dim=-1) / mask.sum(dim=-1)
    a = (adv * mask).sum(dim=-1) / mask.sum(dim=-1)
    (seq_weight * -a * mean_lp).sum().backward()
    torch.testing.assert_close(grad, lp.grad)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"use_sapo_loss": True}, "use_sapo_loss"),
        ({"use_cispo_loss": True}, "use_cispo_loss"),
        ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
        ({"use_decoupled_loss": True}, "use_decoupled_loss"),
        ({"c_clip": 3.0}, "c_clip"),
        ({"eps_clip_higher": 0.28}, "eps_clip_higher"),
        ({"eps_clip": 0.3}, "eps_clip"),
        ({"loss_mode": "clip_cov"}, "loss_mode"),
        ({"loss_mode": "kl_cov"}, "loss_mode"),
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile"),
    ],
)
def test_refused_combinations_name_the_key(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"algorithm\.loss\.{key}: cannot be combined with use_gmpo_loss: true"):
        structure({"use_gmpo_loss": True, **options}, PPOClipConfig, path="algorithm.loss")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gmpo_eps_low": 0.2}, r"algorithm\.loss\.gmpo_eps_low: applies only with use_gmpo_loss: true"),
        ({"gmpo_eps_high": 0.3}, r"algorithm\.loss\.gmpo_eps_high: applies only with use_gmpo_loss: true"),
        ({"use_gmpo_loss": True, "gmpo_eps_low": 0.0}, r"algorithm\.loss\.gmpo_eps_low: must be"),
        ({"use_gmpo_loss": True, "gmpo_eps_high": -1.0}, r"algorithm\.loss\.gmpo_eps_high: must be"),
    ],
)
def test_bounds_are_checked(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        structure(options, PPOClipConfig, path="algorithm.loss")


def test_default_is_the_clipped_surrogate_bitwise() -> None:
    """Off (the default), the loss is PPO's clipped surrogate exactly as composed from the ops, and
    GMPO's differs on the same batch."""
    cfg = structure({}, PPOClipConfig)
    assert (cfg.use_gmpo_loss, cfg.gmpo_eps_low, cfg.gmpo_eps_high) == (False, 0.4, 0.4)
    batch = make_rl_batch(seed=3)
    g = torch.Generator().manual_seed(3)
    lp = batch["old_logprobs"] + torch.randn(batch["old_logprobs"].shape, generator=g) * 0.3 * batch["loss_mask"]
    out = PPOClipLoss(cfg)(batch, lp, torch.zeros_like(lp))
    mask = batch["response_mask"]
    ratio = torch.exp(ops.clamp_log_ratio(lp - batch["old_logprobs"]))
    want, clipped, _ = ops.ppo_clip_loss(ratio, batch["advantages"], eps_low=0.2, eps_high=0.2)
    assert torch.equal(out.per_token_loss, torch.where(mask != 0, want, torch.zeros_like(want)) * mask)
    assert torch.equal(out.token_metrics["clipped"], clipped.to(mask.dtype) * mask)
    other = gmpo()(batch, lp, torch.zeros_like(lp)).per_token_loss
    assert not torch.allclose(other, out.per_token_loss)


def test_tiny_grpo_runs_with_gmpo(tmp_path: Path) -> None:
    """examples/tiny_grpo (model, data, a one-step warm start, then GRPO) for 3 steps with
    ``use_gmpo_loss``: it completes and every step's loss, gradient and clip fraction are finite."""
    for dist in ("core_rl_fsdp", "core_rl_hf"):
        pytest.importorskip(dist)
    from core_rl.builtin.loggers import read_metrics
    from core_rl.testing.launch import run_script

    work = tmp_path / "work"
    options = ["use_gmpo_loss=true", "aggregation=seq-mean-token-mean"]
    steps = ["trainer.total_steps=3", "saver.every_n_steps=0", "data.batch_size=8", "eval.before_train=false"]
    script = ROOT / "examples" / "tiny_grpo" / "main.py"
    run_script(script, "--workdir", str(work), "--warm-steps", "1", *steps, *(f"algorithm.loss.{o}" for o in options))
    rows = read_metrics(work / "grpo" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for key in ("actor/loss", "actor/grad_norm", "actor/clipped", "actor/ratio"):
            assert math.isfinite(row[key]), (key, row)
        assert 0.0 <= row["actor/clipped"] <= 1.0
