"""The advantage estimator ``gae``: generalised advantage estimation on a critic's values, with the
KL to the reference folded into the per-token reward (fixed or adaptive coefficient).

Per token (:func:`core_rl.ops.token_level_rewards`, :func:`core_rl.ops.gae_advantages`)::

    r_t = -kl_coef * kl_t + reward * [t is the response's last token]
          (a multi-turn batch with ``turn_rewards``: each turn's reward at its own last token)
    delta_t = r_t + discount * V_{t+1} - V_t,   A_t = delta_t + discount * gae_lambda * A_{t+1}
    returns_t = A_t + V_t                        (the critic's target)

with ``kl_t`` the ``kl_estimator`` estimate of KL(pi_old || pi_ref) at token ``t``. With
``kl_target`` set, ``kl_coef`` adapts after each step (:func:`core_rl.ops.adaptive_kl_coef`, the
observed KL being the mean over sequences of their summed per-token KL, ``n_steps`` the batch's
samples) and is saved in checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from core_rl import ops
from core_rl.interfaces import AdvantageEstimator
from core_rl.protocol import TensorBatch

from core_rl_ppo.config import GAEConfig


class GAEAdvantage(AdvantageEstimator):
    """See the module docstring. Reads ``rewards``, ``values``, ``response_mask`` (and with a KL
    coefficient ``old_logprobs``, ``ref_logprobs``); sets ``batch["returns"]``."""

    requires_values = True

    def __init__(self, config: GAEConfig) -> None:
        self.config = config
        self.kl_coef = config.kl_ctl
        self.requires_reference = config.kl_ctl > 0
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        cfg = self.config
        mask = batch["response_mask"]
        kl = None
        self._metrics = {}
        if self.requires_reference:
            kl = ops.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], cfg.kl_estimator) * mask
        rewards = ops.token_level_rewards(
            batch["rewards"], mask, kl=kl, kl_coef=self.kl_coef, turn_rewards=batch.get("turn_rewards")
        )
        advantages, returns = ops.gae_advantages(
            rewards, batch["values"], mask, discount=cfg.discount, gae_lambda=cfg.gae_lambda
        )
        batch["returns"] = returns
        if kl is not None:
            observed = float(kl.sum(dim=1).mean())
            self._metrics = {"kl_coef": self.kl_coef, "kl_in_reward": observed}
            if cfg.kl_target is not None:
                self.kl_coef = ops.adaptive_kl_coef(
                    self.kl_coef, observed, target=cfg.kl_target, horizon=cfg.kl_horizon, n_steps=batch.batch_size
                )
        return advantages

    def metrics(self) -> dict[str, float]:
        """The last call's ``kl_coef`` (the coefficient it used) and ``kl_in_reward`` (mean summed KL
        per sequence); empty without a KL coefficient. The trainer reports them as ``advantage/...``."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_coef}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "kl_coef" in state:
            self.kl_coef = float(state["kl_coef"])
