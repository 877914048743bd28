"""core-rl-reward-format: the ``format`` reward (see :mod:`.reward`)."""

from core_rl_reward_format.reward import FormatConfig, FormatReward, tag_structure_ok

__all__ = ["FormatConfig", "FormatReward", "tag_structure_ok"]
