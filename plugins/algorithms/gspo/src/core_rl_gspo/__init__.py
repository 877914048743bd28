"""core-rl-gspo: the ``gspo`` algorithm recipe for core-rl. Registered through :mod:`core_rl_gspo.plugin`."""

from core_rl_gspo.recipe import GSPO_DEFAULTS, gspo_recipe

__version__ = "0.1.0"

__all__ = ["GSPO_DEFAULTS", "gspo_recipe"]
