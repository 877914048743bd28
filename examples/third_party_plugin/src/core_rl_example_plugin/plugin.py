"""The hook implementations of ``core-rl-example-plugin``.

``pyproject.toml`` points both entry points (``core_rl.advantage_estimators: rank_advantage`` and
``core_rl.rewards: keyword_reward``) at this module. core-rl imports it the first time a
configuration selects either name and calls every hook implemented here, so both names get
registered at once.
"""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl_example_plugin.advantage import RankAdvantage, RankAdvantageConfig
from core_rl_example_plugin.reward import KeywordReward, KeywordRewardConfig


@hookimpl
def core_rl_register_advantage_estimators(register: Register) -> None:
    """Register ``rank_advantage``; its factory is the class itself: ``RankAdvantage(config)``."""
    register(
        "rank_advantage",
        RankAdvantage,
        description="Group-relative advantage from the centred rank of each reward (ties averaged)",
        config_cls=RankAdvantageConfig,
    )


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    """Register ``keyword_reward``; its factory is the class itself: ``KeywordReward(config)``."""
    register(
        "keyword_reward",
        KeywordReward,
        description="Fraction of required keywords (configured or from the data row) the response mentions",
        config_cls=KeywordRewardConfig,
    )
