"""core-rl-reward-match: the ``exact_match`` and ``char_match`` rewards (see :mod:`.rewards`)."""

from core_rl_reward_match.rewards import CharMatchReward, ExactMatchReward, MatchConfig

__all__ = ["CharMatchReward", "ExactMatchReward", "MatchConfig"]
