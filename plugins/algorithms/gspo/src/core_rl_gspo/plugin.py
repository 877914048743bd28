"""Hook implementations of core-rl-gspo: registration only."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_gspo.recipe import gspo_recipe


@hookimpl
def core_rl_register_algorithms(register: Register) -> None:
    register("gspo", gspo_recipe, description=gspo_recipe().description)
