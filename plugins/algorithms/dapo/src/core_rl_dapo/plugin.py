"""Hook implementations of core-rl-dapo: registration only."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_dapo.recipe import dapo_recipe


@hookimpl
def core_rl_register_algorithms(register: Register) -> None:
    register("dapo", dapo_recipe, description=dapo_recipe().description)
