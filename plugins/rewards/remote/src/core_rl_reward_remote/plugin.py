"""Registration of the ``remote`` reward (entry point group ``core_rl.rewards``)."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward

from core_rl_reward_remote.config import RemoteConfig


def make_remote_reward(config: RemoteConfig) -> Reward:
    """factory(config): httpx is imported here."""
    from core_rl_reward_remote.reward import RemoteReward

    return RemoteReward(config)


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "remote",
        make_remote_reward,
        description="Scores from an HTTP reward service: batched, with timeout, retries and an auth token from the env",
        config_cls=RemoteConfig,
    )
