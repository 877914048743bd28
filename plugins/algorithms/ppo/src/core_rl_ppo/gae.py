"""The advantage estimator ``gae``: generalised advantage estimation on a critic's values, with the
KL to the reference folded into the per-token reward (fixed or adaptive coefficient,
:mod:`core_rl.ops.kl_reward`).

Per token (:meth:`core_rl.ops.kl_reward.KLInReward.token_rewards`, :func:`core_rl.ops.gae_advantages`)::

    r_t = -kl_coef * kl_t + reward * [t is the response's last token]
          (a multi-turn batch with ``turn_rewards``: each turn's reward at its own last token)
    delta_t = r_t + discount * V_{t+1} - V_t,   A_t = delta_t + discount * gae_lambda * A_{t+1}
    returns_t = A_t + V_t                        (the critic's target)

with ``kl_t`` the ``kl_estimator`` estimate of KL(pi_old || pi_ref) at token ``t``. With
``kl_target`` set, ``kl_coef`` adapts after each step (the observed KL being the mean over
sequences of their summed per-token KL, ``n_steps`` the batch's samples) and is saved in
checkpoints.
"""

from __future__ import annotations

import torch
from core_rl import ops
from core_rl.interfaces import AdvantageEstimator
from core_rl.ops.kl_reward import KLRewardEstimator
from core_rl.protocol import TensorBatch

from core_rl_ppo.config import GAEConfig


class GAEAdvantage(KLRewardEstimator, AdvantageEstimator):
    """See the module docstring. Reads ``rewards``, ``values``, ``response_mask`` (and with a KL
    coefficient ``old_logprobs``, ``ref_logprobs``); sets ``batch["returns"]``."""

    requires_values = True

    def __init__(self, config: GAEConfig) -> None:
        self.config = config
        self._init_kl_reward(config)

    @property
    def kl_coef(self) -> float:
        """The KL coefficient the next call uses."""
        return self.kl.coef

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        cfg = self.config
        mask = batch["response_mask"]
        rewards = self.kl.token_rewards(batch, batch["rewards"], turn_rewards=batch.get("turn_rewards"))
        advantages, returns = ops.gae_advantages(
            rewards, batch["values"], mask, discount=cfg.discount, gae_lambda=cfg.gae_lambda
        )
        batch["returns"] = returns
        return advantages
