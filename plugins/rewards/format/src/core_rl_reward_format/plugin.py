"""Registration of the ``format`` reward (entry point group ``core_rl.rewards``)."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_reward_format.reward import FormatConfig, FormatReward


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "format",
        FormatReward,
        description="Checks a response's shape: tags in order (e.g. <think>, <answer>), regexes that must match",
        config_cls=FormatConfig,
    )
