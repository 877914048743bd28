"""Hook implementations of core-rl-grpo: registration only.

Registering imports no torch: the config classes come from :mod:`.config`, and each factory imports
its component (which needs torch) when a run builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core_rl.hookspecs import Register, hookimpl

from core_rl_grpo.config import (
    DropUniformGroupsConfig,
    GRPOAdvantageConfig,
    OnlineDPOAdvantageConfig,
    PPOClipConfig,
    ReinforcePPAdvantageConfig,
    RLOOAdvantageConfig,
)
from core_rl_grpo.recipe import dr_grpo_recipe, grpo_recipe, online_dpo_recipe, reinforce_pp_recipe, rloo_recipe

if TYPE_CHECKING:
    from core_rl_grpo.advantages import GroupRelativeAdvantage, ReinforcePPAdvantage
    from core_rl_grpo.filters import DropUniformGroups
    from core_rl_grpo.losses import PPOClipLoss
    from core_rl_grpo.online_dpo import OnlineDPOAdvantage


def make_grpo(config: GRPOAdvantageConfig) -> GroupRelativeAdvantage:
    from core_rl_grpo.advantages import GroupRelativeAdvantage

    return GroupRelativeAdvantage(
        norm_std=config.norm_std, eps=config.eps, leave_one_out=config.leave_one_out, kl=config
    )


def make_rloo(config: RLOOAdvantageConfig) -> GroupRelativeAdvantage:
    from core_rl_grpo.advantages import GroupRelativeAdvantage

    return GroupRelativeAdvantage(norm_std=config.norm_std, eps=config.eps, leave_one_out=True, kl=config)


def make_reinforce_pp(config: ReinforcePPAdvantageConfig) -> ReinforcePPAdvantage:
    from core_rl_grpo.advantages import ReinforcePPAdvantage

    return ReinforcePPAdvantage(config)


def make_online_dpo(config: OnlineDPOAdvantageConfig) -> OnlineDPOAdvantage:
    from core_rl_grpo.online_dpo import OnlineDPOAdvantage

    return OnlineDPOAdvantage(config)


def make_ppo_clip(config: PPOClipConfig) -> PPOClipLoss:
    from core_rl_grpo.losses import PPOClipLoss

    return PPOClipLoss(config)


def make_drop_uniform_groups(config: DropUniformGroupsConfig) -> DropUniformGroups:
    from core_rl_grpo.filters import DropUniformGroups

    return DropUniformGroups(config)


@hookimpl
def core_rl_register_algorithms(register: Register) -> None:
    for name, recipe in (
        ("grpo", grpo_recipe),
        ("dr_grpo", dr_grpo_recipe),
        ("rloo", rloo_recipe),
        ("reinforce_pp", reinforce_pp_recipe),
        ("online_dpo", online_dpo_recipe),
    ):
        register(name, recipe, description=recipe().description)


@hookimpl
def core_rl_register_advantage_estimators(register: Register) -> None:
    register(
        "grpo",
        make_grpo,
        description="Group-relative: (reward - group mean) / (group std + eps), per response token",
        config_cls=GRPOAdvantageConfig,
    )
    register(
        "rloo",
        make_rloo,
        description="REINFORCE leave-one-out: reward - mean of the other samples of the group",
        config_cls=RLOOAdvantageConfig,
    )
    register(
        "reinforce_pp",
        make_reinforce_pp,
        description="REINFORCE++: outcome returns (optionally minus the group mean) whitened over the batch",
        config_cls=ReinforcePPAdvantageConfig,
    )
    register(
        "online_dpo",
        make_online_dpo,
        description="Online DPO: each group's best and worst samples as a preference pair (a DPO loss's gradient)",
        config_cls=OnlineDPOAdvantageConfig,
    )


@hookimpl
def core_rl_register_policy_losses(register: Register) -> None:
    register(
        "ppo_clip",
        make_ppo_clip,
        description="PPO clipped surrogate, token or sequence level (+ clip-higher, dual clip, KL, entropy, "
        "decoupled loss, SAPO, M2PO)",
        config_cls=PPOClipConfig,
    )


@hookimpl
def core_rl_register_sample_filters(register: Register) -> None:
    register(
        "drop_uniform_groups",
        make_drop_uniform_groups,
        description="Drop groups whose rewards are all equal (no signal for group-relative advantages)",
        config_cls=DropUniformGroupsConfig,
    )
