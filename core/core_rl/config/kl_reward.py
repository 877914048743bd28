"""The options of the KL penalty in the reward, shared by every advantage estimator that offers it
(``algorithm.advantage.kl_ctl`` and its companions), importable without torch.

An estimator's config class inherits :class:`KLInRewardConfig`; the estimator builds a
:class:`core_rl.ops.kl_reward.KLInReward` from it (the formula, the adaptive coefficient and its saved
state live there, once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from core_rl.config.validators import MAX_STEPS, in_range, non_negative, one_of, positive
from core_rl.ops.names import KL_ESTIMATORS

if TYPE_CHECKING:
    from core_rl.config.checks import SectionContext

__all__ = ["KLInRewardConfig"]


@attrs.define
class KLInRewardConfig:
    """KL to the reference folded into the per-token reward before advantages are estimated.

    ``kl_ctl``: the (initial) coefficient ``beta`` (0: off, and no reference model is needed for it);
    ``kl_estimator``: ``k1``, ``k2`` or ``k3`` (:func:`core_rl.ops.kl_estimate`, of
    KL(pi_old || pi_ref) per response token); ``kl_target``: null for a fixed ``beta``, else the KL
    the adaptive controller steers towards; ``kl_horizon``: the controller's horizon (samples)."""

    kl_ctl: float = attrs.field(default=0.0, validator=non_negative())
    kl_estimator: str = attrs.field(default="k1", validator=one_of(KL_ESTIMATORS))
    kl_target: float | None = attrs.field(default=None, validator=positive())
    kl_horizon: int = attrs.field(default=10_000, validator=in_range(1, MAX_STEPS))

    def kl_in_reward_problems(self, context: SectionContext) -> list[str]:
        """An adaptive target needs a coefficient to adapt: one line per mistake."""
        if self.kl_target is not None and self.kl_ctl == 0:
            return [
                f"{context.key('kl_target')}: needs kl_ctl > 0 (the coefficient it adapts); set kl_ctl or remove it"
            ]
        return []

    def check_config(self, context: SectionContext) -> list[str]:
        """See :meth:`kl_in_reward_problems` (subclasses with checks of their own add them to it)."""
        return self.kl_in_reward_problems(context)
