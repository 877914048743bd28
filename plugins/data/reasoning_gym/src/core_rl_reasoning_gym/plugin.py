"""Registration of the ``reasoning_gym`` data source (entry point group ``core_rl.data_sources``)
and the ``reasoning_gym`` reward (``core_rl.rewards``)."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_reasoning_gym.reward import ReasoningGymReward, ReasoningGymRewardConfig
from core_rl_reasoning_gym.source import ReasoningGymSource, ReasoningGymSourceConfig


@hookimpl
def core_rl_register_data_sources(register: Register) -> None:
    register(
        "reasoning_gym",
        ReasoningGymSource,
        description="reasoning-gym's procedural tasks by name (size rows each, seeded), metadata kept as made",
        config_cls=ReasoningGymSourceConfig,
    )


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "reasoning_gym",
        ReasoningGymReward,
        description="the answer in <answer> tags scored by the row's reasoning-gym task's own scorer",
        config_cls=ReasoningGymRewardConfig,
    )
