"""core-rl-ppo: PPO with a critic for core-rl (algorithms ``ppo`` and ``distill``; advantage
estimator ``gae``). The policy loss is core-rl-grpo's ``ppo_clip``; the math is in
:mod:`core_rl.ops`. Registered through :mod:`core_rl_ppo.plugin`."""

from core_rl_ppo.gae import GAEAdvantage, GAEConfig
from core_rl_ppo.recipe import distill_recipe, ppo_recipe

__version__ = "0.1.0"

__all__ = ["GAEAdvantage", "GAEConfig", "distill_recipe", "ppo_recipe"]
