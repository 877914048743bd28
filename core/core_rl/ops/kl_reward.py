"""The KL penalty in the reward, shared by every advantage estimator that offers it (``gae``,
``grpo``, ``rloo``, ``reinforce_pp``): one place for the per-token reward, the adaptive
coefficient and its checkpointed state. Options: :class:`core_rl.config.kl_reward.KLInRewardConfig`.

Per response token (:func:`core_rl.ops.token_level_rewards`, Ziegler et al. 2019)::

    kl_t = KL_est(pi_old || pi_ref)_t            (kl_estimator; 0 off the response mask)
    r_t  = score * [t is the response's last token] - beta * kl_t

``pi_old`` is the trainer's own forward: with the KL in the reward the update always recomputes
``old_logprobs`` (:class:`core_rl.loops.rl.update.PolicyUpdate`), so the rollout engine's numerical
gap to the trainer (and, in asynchronous runs, the behaviour policy's age) never enters the KL.

Estimators that work per token (``gae``, ``reinforce_pp``) take ``r_t`` as it is
(:meth:`KLInReward.token_rewards`). Estimators of one scalar reward per sequence (``grpo``,
``rloo``) take the sequence's undiscounted return (:meth:`KLInReward.sequence_rewards`)::

    R = sum_t r_t = score - beta * sum_t kl_t

before the group baseline and normalisation (a response with no token keeps no score: it has
no last token to pay it at).

With ``kl_target`` set, ``beta`` adapts after each call (:func:`core_rl.ops.adaptive_kl_coef`):
the observed KL is the mean over sequences of their summed ``kl_t``, ``n_steps`` the batch's
sample count. ``beta`` is the estimator's checkpointed state (``{"kl_coef": beta}``). The metrics of
the last call are ``kl_coef`` (the ``beta`` it used) and ``kl_in_reward`` (the observed KL).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from core_rl import ops
from core_rl.config.kl_reward import KLInRewardConfig
from core_rl.protocol import TensorBatch

__all__ = ["KLInReward"]


class KLInReward:
    """The KL-in-reward state of one estimator (module docstring). Reads ``response_mask``,
    ``old_logprobs`` and ``ref_logprobs`` of a batch when on."""

    def __init__(self, config: KLInRewardConfig) -> None:
        self.config = config
        #: beta, the coefficient the next call uses
        self.coef = float(config.kl_ctl)
        self._metrics: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        """Whether the reward carries a KL penalty (``kl_ctl > 0``): the batch then needs
        ``ref_logprobs``, so the estimator declares ``requires_reference``."""
        return self.config.kl_ctl > 0

    def estimate(self, batch: TensorBatch) -> torch.Tensor | None:
        """``kl_t`` ``[B, T]`` (0 off the response mask); ``None`` when off."""
        if not self.enabled:
            return None
        mask = batch["response_mask"]
        return ops.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], self.config.kl_estimator) * mask

    def observe(self, kl: torch.Tensor | None, n_samples: int) -> None:
        """Record the metrics of ``kl`` (the :meth:`estimate` a call used with :attr:`coef`) and
        update the adaptive coefficient once (``n_steps = n_samples``). ``None``: no metrics."""
        self._metrics = {}
        if kl is None:
            return
        cfg = self.config
        observed = float(kl.sum(dim=1).mean())
        self._metrics = {"kl_coef": self.coef, "kl_in_reward": observed}
        if cfg.kl_target is not None:
            self.coef = ops.adaptive_kl_coef(
                self.coef, observed, target=cfg.kl_target, horizon=cfg.kl_horizon, n_steps=n_samples
            )

    def token_rewards(
        self, batch: TensorBatch, scores: torch.Tensor, *, turn_rewards: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token rewards ``[B, T]`` of ``scores [B]`` with the penalty (none when off), then
        :meth:`observe`. ``turn_rewards``: see :func:`core_rl.ops.token_level_rewards`."""
        kl = self.estimate(batch)
        rewards = ops.token_level_rewards(
            scores, batch["response_mask"], kl=kl, kl_coef=self.coef, turn_rewards=turn_rewards
        )
        self.observe(kl, batch.batch_size)
        return rewards

    def sequence_rewards(self, batch: TensorBatch, scores: torch.Tensor) -> torch.Tensor:
        """``R = sum_t r_t`` ``[B]`` (module docstring); ``scores`` themselves when off."""
        if not self.enabled:
            self.observe(None, batch.batch_size)
            return scores
        return self.token_rewards(batch, scores).sum(dim=1)

    def metrics(self) -> dict[str, float]:
        """The last call's ``kl_coef`` and ``kl_in_reward``; empty when off."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.coef}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "kl_coef" in state:
            self.coef = float(state["kl_coef"])


class KLRewardEstimator:
    """Mixin of an :class:`core_rl.interfaces.AdvantageEstimator` with a KL penalty in its reward:
    ``requires_reference`` when on, and the penalty's metrics and checkpointed state."""

    kl: KLInReward
    requires_reference: bool

    def _init_kl_reward(self, config: KLInRewardConfig | None) -> None:
        self.kl = KLInReward(config if config is not None else KLInRewardConfig())
        self.requires_reference = self.kl.enabled

    def metrics(self) -> dict[str, float]:
        """The last call's ``kl_coef`` and ``kl_in_reward`` (empty without a KL coefficient); the
        trainer reports them as ``advantage/...``."""
        return self.kl.metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.kl.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kl.load_state_dict(state)
