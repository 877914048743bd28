"""Registration of the ``reward_model`` reward (entry point group ``core_rl.rewards``); imports no torch."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import Reward

from core_rl_reward_model.config import RewardModelConfig


def make_reward_model(config: RewardModelConfig) -> Reward:
    """factory(config): loads the model (torch and transformers are imported here)."""
    from core_rl_reward_model.reward import ModelReward

    return ModelReward(config)


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "reward_model",
        make_reward_model,
        description="Score of prompt+response from a frozen Hugging Face sequence-classification model",
        config_cls=RewardModelConfig,
    )
