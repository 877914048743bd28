"""core-rl-grpo: the GRPO algorithm for core-rl (advantages ``grpo`` and ``rloo``, loss ``ppo_clip``,
filter ``drop_uniform_groups``, algorithm ``grpo``). Registered through :mod:`core_rl_grpo.plugin`."""

from core_rl_grpo.advantages import GroupRelativeAdvantage, group_relative_scores, grpo_advantages
from core_rl_grpo.filters import DropUniformGroups, varied_groups
from core_rl_grpo.losses import PPOClipLoss, policy_ratio, ppo_clip_loss
from core_rl_grpo.recipe import grpo_recipe

__version__ = "0.1.0"

__all__ = [
    "DropUniformGroups",
    "GroupRelativeAdvantage",
    "PPOClipLoss",
    "group_relative_scores",
    "grpo_advantages",
    "grpo_recipe",
    "policy_ratio",
    "ppo_clip_loss",
    "varied_groups",
]
