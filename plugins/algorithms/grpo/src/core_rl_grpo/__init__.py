"""core-rl-grpo: GRPO and its variants for core-rl (algorithms ``grpo``, ``dr_grpo``, ``rloo``,
``reinforce_pp``; advantages ``grpo``, ``rloo``, ``reinforce_pp``; loss ``ppo_clip``; filter
``drop_uniform_groups``). Registered through :mod:`core_rl_grpo.plugin`.

The names below are imported on first access, so importing the package (as registering the plugin
does) imports no torch.
"""

from __future__ import annotations

from core_rl.plugins import lazy_exports

__version__ = "0.1.0"

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl_grpo.advantages": (
            "GroupRelativeAdvantage",
            "ReinforcePPAdvantage",
            "group_relative_scores",
            "grpo_advantages",
            "reinforce_pp_advantages",
        ),
        "core_rl_grpo.config": ("PPOClipConfig",),
        "core_rl_grpo.filters": ("DropUniformGroups", "varied_groups"),
        "core_rl_grpo.losses": ("PPOClipLoss", "policy_ratio", "ppo_clip_loss"),
        "core_rl_grpo.recipe": ("dr_grpo_recipe", "grpo_recipe", "reinforce_pp_recipe", "rloo_recipe"),
    },
)
