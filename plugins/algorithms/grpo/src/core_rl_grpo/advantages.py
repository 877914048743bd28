"""Advantage estimators: ``grpo`` (group mean baseline, optionally divided by the group standard
deviation), ``rloo`` (leave-one-out baseline, no normalisation) and ``reinforce_pp`` (REINFORCE++:
returns whitened over the batch, with or without a group baseline).

Outcome rewards are scalars per sample; every response token of a sample gets the sample's advantage.

KL in the reward (``kl_ctl > 0``, :mod:`core_rl.ops.kl_reward`; the estimator then declares
``requires_reference`` and runs in the update, after the reference log-probs): ``grpo`` and ``rloo``
replace each score by ``score - kl_ctl * sum_t kl_t`` before the group statistics (the sequence's
return of per-token rewards); ``reinforce_pp`` pays ``-kl_ctl * kl_t`` at every response token and
discounts it into the returns with ``gamma`` like the outcome, before the batch whitening.
"""

from __future__ import annotations

import torch
from core_rl import ops
from core_rl.config.kl_reward import KLInRewardConfig
from core_rl.interfaces import AdvantageEstimator
from core_rl.ops.kl_reward import KLRewardEstimator
from core_rl.protocol import TensorBatch

from core_rl_grpo.config import ReinforcePPAdvantageConfig


def group_relative_scores(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
    leave_one_out: bool = False,
) -> torch.Tensor:
    """Per-sample advantages [B] from scalar rewards [B] and group labels [B]
    (:func:`core_rl.ops.normalize` at group level).

    For sample ``i`` of group ``g`` with ``n = |g|`` members and rewards ``r``::

        mean_g = (1/n) * sum_{j in g} r_j
        std_g  = sqrt( sum_{j in g} (r_j - mean_g)^2 / (n - 1) )      # unbiased (Bessel), as torch.std
        b_i    = mean_g                                   if not leave_one_out
        b_i    = (sum_{j in g} r_j - r_i) / (n - 1)       if leave_one_out   (mean of the *other* members)
        A_i    = r_i - b_i                                # leave_one_out: A_i = n/(n-1) * (r_i - mean_g)
        A_i    = A_i / (std_g + eps)                      if norm_std

    A group whose rewards are all equal (including a group of one) gets exactly ``A_i = 0``: it carries
    no relative signal, and forcing the zero keeps rounding in ``mean_g`` from leaking
    ``O(ulp) / eps`` noise.
    """
    return ops.normalize(
        rewards.detach(),
        group_index=group_index,
        mean_level="group",
        std_level="group" if norm_std else "none",
        leave_one_out=leave_one_out,
        unbiased=True,
        eps=eps,
    )


def broadcast_to_response(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] advantages: ``A_{i,t} = scores_i * response_mask_{i,t}``."""
    return scores.to(response_mask.device)[:, None] * response_mask.float()


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
    leave_one_out: bool = False,
) -> torch.Tensor:
    """Token-level advantages [B, T]: :func:`group_relative_scores` broadcast over each response."""
    scores = group_relative_scores(rewards, group_index, norm_std=norm_std, eps=eps, leave_one_out=leave_one_out)
    return broadcast_to_response(scores, response_mask)


class GroupRelativeAdvantage(KLRewardEstimator, AdvantageEstimator):
    """Reads ``rewards``, ``group_index`` and ``response_mask`` (and with ``kl.kl_ctl > 0``
    ``old_logprobs``, ``ref_logprobs``); see :func:`group_relative_scores`. The scores are
    :meth:`core_rl.ops.kl_reward.KLInReward.sequence_rewards` of the rewards: ``r_i - kl_ctl * sum_t kl_{i,t}``."""

    def __init__(
        self,
        *,
        norm_std: bool = True,
        eps: float = 1e-6,
        leave_one_out: bool = False,
        kl: KLInRewardConfig | None = None,
    ) -> None:
        self.norm_std = norm_std
        self.eps = eps
        self.leave_one_out = leave_one_out
        self._init_kl_reward(kl)

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        return grpo_advantages(
            self.kl.sequence_rewards(batch, batch["rewards"]),
            batch["group_index"],
            batch["response_mask"],
            norm_std=self.norm_std,
            eps=self.eps,
            leave_one_out=self.leave_one_out,
        )


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_baseline: bool = False,
    gamma: float = 1.0,
    eps: float = 1e-5,
    turn_rewards: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """REINFORCE++ advantages [B, T] (Hu 2025): outcome returns whitened over the whole batch::

        s_i     = r_i - mean_{g(i)}            (group_baseline: REINFORCE++-baseline)
        s_i     = r_i                          (otherwise)
        G_{i,t} = gamma^{k_{i,t}} * s_i        k_{i,t}: response tokens of i after t
        A_{i,t} = (G_{i,t} - mean(G)) / (std(G) + eps)

    mean and (unbiased) std over every response token of the batch, so a sample weighs as many
    tokens as it has. Equal rewards across the whole batch (gamma 1) give exactly 0. The group
    baseline subtracts the group mean first; whitening then shifts every token by the batch mean,
    so a group with equal rewards is not 0 unless every group is.

    With ``turn_rewards`` ``[B, T]`` (a multi-turn batch) or a KL penalty (``kl`` ``[B, T]``,
    ``kl_coef > 0``), ``G_{i,t}`` is the discounted sum of the per-token rewards from ``t`` on
    (:func:`core_rl.ops.token_level_rewards`: each turn's reward at its last token, the rest of
    ``s_i`` at the response's last token, ``-kl_coef * kl_{i,t}`` at every response token)::

        G_{i,t} = sum_{t' >= t} gamma^{k(t, t')} * r_{i,t'}      k(t, t'): response tokens in (t, t']

    computed as GAE with ``lambda = 1`` on zero values.
    """
    scores = rewards.detach().float()
    if group_baseline:
        scores = ops.normalize(scores, group_index=group_index, mean_level="group", std_level="none")
    scores = scores.to(response_mask.device)
    if turn_rewards is None and (kl is None or not kl_coef):
        returns = ops.discounted_outcome_returns(scores, response_mask, gamma)
    else:
        per_token = ops.token_level_rewards(scores, response_mask, kl=kl, kl_coef=kl_coef, turn_rewards=turn_rewards)
        zeros = torch.zeros_like(per_token)
        returns, _ = ops.gae_advantages(per_token, zeros, response_mask, discount=gamma, gae_lambda=1.0)
    return ops.normalize(returns, mask=response_mask, mean_level="batch", std_level="batch", eps=eps)


class ReinforcePPAdvantage(KLRewardEstimator, AdvantageEstimator):
    """Reads ``rewards``, ``group_index``, ``response_mask`` (and ``turn_rewards`` where the batch has
    them; with ``kl_ctl > 0`` ``old_logprobs``, ``ref_logprobs``); see :func:`reinforce_pp_advantages`
    (``kl``: :meth:`core_rl.ops.kl_reward.KLInReward.estimate`, at the current coefficient)."""

    def __init__(self, config: ReinforcePPAdvantageConfig | None = None) -> None:
        self.config = config if config is not None else ReinforcePPAdvantageConfig()
        self._init_kl_reward(self.config)

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        cfg = self.config
        kl = self.kl.estimate(batch)
        advantages = reinforce_pp_advantages(
            batch["rewards"],
            batch["group_index"],
            batch["response_mask"],
            group_baseline=cfg.group_baseline,
            gamma=cfg.gamma,
            eps=cfg.eps,
            turn_rewards=batch.get("turn_rewards"),
            kl=kl,
            kl_coef=self.kl.coef,
        )
        self.kl.observe(kl, batch.batch_size)
        return advantages
