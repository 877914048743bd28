"""core-rl-ppo: PPO with a critic for core-rl (algorithms ``ppo`` and ``distill``; advantage
estimator ``gae``). The policy loss is core-rl-grpo's ``ppo_clip``; the math is in
:mod:`core_rl.ops`. Registered through :mod:`core_rl_ppo.plugin`.

The names below are imported on first access, so importing the package (as registering the plugin
does) imports no torch.
"""

from __future__ import annotations

from core_rl.plugins import lazy_exports

__version__ = "0.1.0"

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl_ppo.config": ("GAEConfig",),
        "core_rl_ppo.gae": ("GAEAdvantage",),
        "core_rl_ppo.recipe": ("distill_recipe", "ppo_recipe"),
    },
)
