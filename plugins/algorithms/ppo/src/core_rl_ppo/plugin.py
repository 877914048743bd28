"""Hook implementations of core-rl-ppo: registration only."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_ppo.gae import GAEConfig, make_gae
from core_rl_ppo.recipe import distill_recipe, ppo_recipe


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
