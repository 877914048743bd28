"""Registration of the ``code`` reward (entry point group ``core_rl.rewards``)."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward

from core_rl_reward_code.config import CodeConfig


def make_code_reward(config: CodeConfig) -> Reward:
    """factory(config): checks that this machine can sandbox programs."""
    from core_rl_reward_code.reward import CodeReward

    return CodeReward(config)


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "code",
        make_code_reward,
        description="Fraction/all of the row's tests passed by the response's Python code, run in a sandbox",
        config_cls=CodeConfig,
    )
