"""The configuration class of core-rl-ppo's advantage estimator (``algorithm.advantage: gae``),
importable without torch: registering the plugin and validating a configuration import this module
only; :mod:`.gae` imports torch when a run builds the estimator."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
from core_rl.config.kl_reward import KLInRewardConfig
from core_rl.config.validators import in_range

if TYPE_CHECKING:
    from core_rl.config.checks import SectionContext

__all__ = ["GAEConfig"]


@attrs.define
class GAEConfig(KLInRewardConfig):
    """``algorithm.advantage`` options of ``gae`` (module docstring): ``discount``, ``gae_lambda``;
    the KL in the reward (:class:`core_rl.config.kl_reward.KLInRewardConfig`): ``kl_ctl`` (the
    initial KL coefficient; 0: no KL in the reward, no reference model needed for it),
    ``kl_estimator``, ``kl_target`` (null: a fixed coefficient) and ``kl_horizon``."""

    discount: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    gae_lambda: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))

    def check_config(self, context: SectionContext) -> list[str]:
        """GAE needs a critic; an adaptive target needs a coefficient to adapt."""
        problems = []
        if context.run.critic is None:
            problems.append(
                f"critic: {context.path} {context.name!r} needs a value model; add a critic: section "
                "(e.g. critic: {model_path: ...}; the ppo recipe starts it from actor.model_path)"
            )
        return problems + self.kl_in_reward_problems(context)
