"""Hook implementations of core-rl-ppo: registration only.

Registering imports no torch: the config class comes from :mod:`.config`, and the factory imports
the estimator (which needs torch) when a run builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core_rl.hookspecs import Register, hookimpl

from core_rl_ppo.config import GAEConfig
from core_rl_ppo.recipe import distill_recipe, ppo_recipe

if TYPE_CHECKING:
    from core_rl_ppo.gae import GAEAdvantage


def make_gae(config: GAEConfig | None) -> GAEAdvantage:
    from core_rl_ppo.gae import GAEAdvantage

    return GAEAdvantage(config if config is not None else GAEConfig())


@hookimpl
def core_rl_register_algorithms(register: Register) -> None:
    for name, recipe in (("ppo", ppo_recipe), ("distill", distill_recipe)):
        register(name, recipe, description=recipe().description)


@hookimpl
def core_rl_register_advantage_estimators(register: Register) -> None:
    register(
        "gae",
        make_gae,
        description="Generalised advantage estimation on a critic's values (+ KL to the reference in the reward)",
        config_cls=GAEConfig,
    )
