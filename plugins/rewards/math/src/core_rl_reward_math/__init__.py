"""core-rl-reward-math: the ``math`` reward (see :mod:`.reward`)."""

from core_rl_reward_math.config import MathConfig
from core_rl_reward_math.extract import extract_answer

__all__ = ["MathConfig", "extract_answer"]
