"""Registration of the ``remote`` reward (entry point group ``core_rl.rewards``)."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward

from core_rl_reward_remote.config import JudgeConfig, RemoteConfig


def make_remote_reward(config: RemoteConfig) -> Reward:
    """factory(config): httpx is imported here."""
    from core_rl_reward_remote.reward import RemoteReward

    return RemoteReward(config)


def make_judge_reward(config: JudgeConfig) -> Reward:
    """factory(config): httpx is imported here."""
    from core_rl_reward_remote.judge import JudgeReward

    return JudgeReward(config)


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "remote",
        make_remote_reward,
        description="Scores from an HTTP reward service: batched, with timeout, retries and an auth token from the env",
        config_cls=RemoteConfig,
    )
    register(
        "judge",
        make_judge_reward,
        description="An LLM judge through an OpenAI-compatible chat endpoint: a prompt template, the score parsed "
        "from its reply and scaled to [0, 1]",
        config_cls=JudgeConfig,
    )
