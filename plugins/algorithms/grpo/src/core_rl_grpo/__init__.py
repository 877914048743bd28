"""core-rl-grpo: GRPO and its variants for core-rl (algorithms ``grpo``, ``dr_grpo``, ``rloo``,
``reinforce_pp``; advantages ``grpo``, ``rloo``, ``reinforce_pp``; loss ``ppo_clip``; filter
``drop_uniform_groups``). Registered through :mod:`core_rl_grpo.plugin`."""

from core_rl_grpo.advantages import (
    GroupRelativeAdvantage,
    ReinforcePPAdvantage,
    group_relative_scores,
    grpo_advantages,
    reinforce_pp_advantages,
)
from core_rl_grpo.filters import DropUniformGroups, varied_groups
from core_rl_grpo.losses import PPOClipConfig, PPOClipLoss, policy_ratio, ppo_clip_loss
from core_rl_grpo.recipe import dr_grpo_recipe, grpo_recipe, reinforce_pp_recipe, rloo_recipe

__version__ = "0.1.0"

__all__ = [
    "DropUniformGroups",
    "GroupRelativeAdvantage",
    "PPOClipConfig",
    "PPOClipLoss",
    "ReinforcePPAdvantage",
    "dr_grpo_recipe",
    "group_relative_scores",
    "grpo_advantages",
    "grpo_recipe",
    "policy_ratio",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_recipe",
    "rloo_recipe",
    "varied_groups",
]
