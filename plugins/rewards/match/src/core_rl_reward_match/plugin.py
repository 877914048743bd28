"""Registration of the ``exact_match`` and ``char_match`` rewards (entry point group ``core_rl.rewards``)."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl

from core_rl_reward_match.rewards import CharMatchReward, ExactMatchReward, MatchConfig


@hookimpl
def core_rl_register_rewards(register: Register) -> None:
    register(
        "exact_match",
        ExactMatchReward,
        description="1 if the response equals the row's answer (after normalisation), else 0",
        config_cls=MatchConfig,
    )
    register(
        "char_match",
        CharMatchReward,
        description="Fraction of positions where response and answer characters agree (partial credit)",
        config_cls=MatchConfig,
    )
