"""Registration of the ``math`` reward (entry point group ``core_rl.rewards``); imports neither
math-verify nor sympy."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward

from core_rl_reward_math.config import MathConfig


def make_math_reward(config: MathConfig) -> Reward:
    """factory(config): the reward starts its verifier worker processes lazily."""
    from core_rl_reward_math.reward import MathReward

    return MathReward(config)


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "math",
        make_math_reward,
        description="1 if the final answer (boxed / 'answer is' / last number) equals the row's answer (math-verify)",
        config_cls=MathConfig,
    )
