"""core-rl-dapo: the ``dapo`` algorithm recipe for core-rl. Registered through :mod:`core_rl_dapo.plugin`."""

from core_rl_dapo.recipe import DAPO_DEFAULTS, dapo_recipe

__version__ = "0.1.0"

__all__ = ["DAPO_DEFAULTS", "dapo_recipe"]
