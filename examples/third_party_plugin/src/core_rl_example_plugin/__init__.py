"""An example third-party core-rl plugin.

- ``rank_advantage`` (advantage estimator): :class:`~core_rl_example_plugin.advantage.RankAdvantage`
- ``keyword_reward`` (reward): :class:`~core_rl_example_plugin.reward.KeywordReward`

The hook implementations are in :mod:`core_rl_example_plugin.plugin`.
"""

__version__ = "0.1.0"
