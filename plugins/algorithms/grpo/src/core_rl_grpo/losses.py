"""The PPO clipped surrogate (``ppo_clip``) with optional asymmetric clipping, dual clipping, a KL
penalty towards a reference model and an entropy bonus.

All tensors are [b, T] and follow :mod:`core_rl.protocol` (position ``t`` describes token ``t``).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from core_rl.config.validators import MAX_TOKENS, FieldValueError, in_range, non_negative, one_of, positive
from core_rl.interfaces import LossOutput, PolicyLoss
from core_rl.ops import AGGREGATIONS, KL_ESTIMATORS, aggregation_weights, kl_estimate
from core_rl.protocol import TensorBatch

#: log-ratios are clamped to this range before ``exp`` so the ratio stays finite
MAX_LOG_RATIO = 20.0


def policy_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Importance ratio ``rho = exp(logprobs - old_logprobs)`` = pi(a|s) / pi_old(a|s).

    The log-ratio is clamped to [-20, 20] first (rho in [2e-9, 5e8]) to keep it finite.
    """
    return torch.exp((logprobs - old_logprobs).clamp(min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO))


def ppo_clip_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss (to minimise) and where each clip is active.

    With ``rho`` the ratio and ``A`` the advantage::

        l_unclipped = -A * rho
        l_clipped   = -A * clip(rho, 1 - eps_low, 1 + eps_high)
        l           = max(l_unclipped, l_clipped)                     # PPO (Schulman et al. 2017)
        l           = min(l, -c * A)          where A < 0, if dual_clip = c > 1   (Ye et al. 2020)

    Returns ``(l, clipped, dual_clipped)``: ``clipped`` is True where the trust-region clip is the
    active branch (``l_clipped > l_unclipped``: the ratio left the range in the direction the
    advantage favours, so the gradient is 0); ``dual_clipped`` is True where the dual clip bounds
    the loss (A < 0 and ``rho > c`` past the upper clip; gradient 0 too).
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(min=1.0 - eps_low, max=1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is None:
        return loss, clipped, torch.zeros_like(clipped)
    bound = -dual_clip * advantages
    dual_clipped = (advantages < 0) & (loss > bound)
    return torch.where(dual_clipped, bound, loss), clipped, dual_clipped


def _greater_than_one(_inst: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 1.0:
        raise FieldValueError(attribute.name, value, "must be > 1 (or null to disable)")


@attrs.define
class PPOClipConfig:
    """``algorithm.loss`` options of ``ppo_clip`` (see the README for the formulas).

    ``eps_clip``: lower clip (and upper, unless ``eps_clip_higher`` is set); ``dual_clip``: bound
    ``c > 1`` on the loss of negative-advantage tokens; ``aggregation``: how token losses are
    averaged (:data:`core_rl.ops.AGGREGATIONS`); ``norm_length``: the constant of
    ``seq-mean-token-sum-norm`` (default: the padded width); ``kl_coef``/``kl_estimator``: KL penalty
    towards the reference model (``kl_coef > 0`` builds one); ``entropy_coef``: entropy bonus.
    """

    eps_clip: float = attrs.field(default=0.2, validator=in_range(0.0, 1.0, low_open=True))
    eps_clip_higher: float | None = attrs.field(default=None, validator=positive())
    dual_clip: float | None = attrs.field(default=None, validator=_greater_than_one)
    aggregation: str = attrs.field(default="token-mean", validator=one_of(AGGREGATIONS))
    norm_length: int | None = attrs.field(default=None, validator=in_range(1, MAX_TOKENS))
    kl_coef: float = attrs.field(default=0.0, validator=non_negative())
    kl_estimator: str = attrs.field(default="k3", validator=one_of(KL_ESTIMATORS))
    entropy_coef: float = attrs.field(default=0.0, validator=non_negative())

    def __attrs_post_init__(self) -> None:
        if self.norm_length is not None and self.aggregation != "seq-mean-token-sum-norm":
            raise FieldValueError(
                "norm_length",
                self.norm_length,
                f"must be unset unless aggregation is 'seq-mean-token-sum-norm' (it is {self.aggregation!r})",
            )


class PPOClipLoss(PolicyLoss):
    """Per-token loss::

        loss_t = mask_t * ( ppo_clip_loss(rho_t, A_t)
                            + kl_coef * KL_est(logprobs_t, ref_logprobs_t)    # if kl_coef > 0
                            - entropy_coef * H_t )                              # if entropy_coef > 0

    Token metrics (0 off the response): ``ratio``, ``clipped`` (0/1), ``dual_clipped`` (0/1, with
    ``dual_clip``), ``approx_kl`` (k3 estimate of KL(pi_old || pi), an off-policy-ness diagnostic),
    ``kl`` (the penalty's estimate, when ``kl_coef > 0``).
    """

    def __init__(self, config: PPOClipConfig | None = None) -> None:
        self.config = config if config is not None else PPOClipConfig()
        self.eps_low = self.config.eps_clip
        self.eps_high = self.config.eps_clip_higher if self.config.eps_clip_higher is not None else self.config.eps_clip
        self.requires_reference = self.config.kl_coef > 0

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        return aggregation_weights(response_mask, self.config.aggregation, norm_length=self.config.norm_length)

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        cfg = self.config
        mask = batch["response_mask"].to(logprobs.dtype)
        old_logprobs = batch["old_logprobs"].to(logprobs.dtype)
        advantages = batch["advantages"].to(logprobs.dtype)

        ratio = policy_ratio(logprobs, old_logprobs)
        loss, clipped, dual_clipped = ppo_clip_loss(
            ratio, advantages, eps_low=self.eps_low, eps_high=self.eps_high, dual_clip=cfg.dual_clip
        )
        metrics = {
            "ratio": ratio.detach() * mask,
            "clipped": clipped.to(mask.dtype) * mask,
            "approx_kl": kl_estimate(old_logprobs, logprobs.detach(), "k3") * mask,
        }
        if cfg.dual_clip is not None:
            metrics["dual_clipped"] = dual_clipped.to(mask.dtype) * mask
        if cfg.kl_coef > 0:
            if "ref_logprobs" not in batch:
                raise KeyError("ppo_clip with kl_coef > 0 needs 'ref_logprobs' in the batch (a reference model)")
            kl = kl_estimate(logprobs, batch["ref_logprobs"].to(logprobs.dtype), cfg.kl_estimator)
            loss = loss + cfg.kl_coef * kl
            metrics["kl"] = kl.detach() * mask
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy
        return LossOutput(per_token_loss=loss * mask, token_metrics=metrics)


def make_ppo_clip(config: PPOClipConfig) -> PPOClipLoss:
    return PPOClipLoss(config)
