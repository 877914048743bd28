"""The configuration class of core-rl-ppo's advantage estimator (``algorithm.advantage: gae``),
importable without torch: registering the plugin and validating a configuration import this module
only; :mod:`.gae` imports torch when a run builds the estimator."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
from core_rl.config.validators import MAX_STEPS, in_range, non_negative, one_of, positive
from core_rl.ops.names import KL_ESTIMATORS

if TYPE_CHECKING:
    from core_rl.config.checks import SectionContext

__all__ = ["GAEConfig"]


@attrs.define
class GAEConfig:
    """``algorithm.advantage`` options of ``gae`` (module docstring): ``discount``, ``gae_lambda``;
    ``kl_ctl`` (the initial KL coefficient in the reward; 0: no KL in the reward, no reference model
    needed for it), ``kl_estimator``, ``kl_target`` (null: a fixed coefficient) and ``kl_horizon``."""

    discount: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    gae_lambda: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    kl_ctl: float = attrs.field(default=0.0, validator=non_negative())
    kl_estimator: str = attrs.field(default="k1", validator=one_of(KL_ESTIMATORS))
    kl_target: float | None = attrs.field(default=None, validator=positive())
    kl_horizon: int = attrs.field(default=10_000, validator=in_range(1, MAX_STEPS))

    def check_config(self, context: SectionContext) -> list[str]:
        """GAE needs a critic; an adaptive target needs a coefficient to adapt."""
        problems = []
        if context.run.critic is None:
            problems.append(
                f"critic: {context.path} {context.name!r} needs a value model; add a critic: section "
                "(e.g. critic: {model_path: ...}; the ppo recipe starts it from actor.model_path)"
            )
        if self.kl_target is not None and self.kl_ctl == 0:
            problems.append(f"{context.key('kl_target')}: needs kl_ctl > 0 (the coefficient it adapts)")
        return problems
