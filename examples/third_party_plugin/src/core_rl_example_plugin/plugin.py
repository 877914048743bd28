"""The hook implementations of ``core-rl-example-plugin``.

``pyproject.toml`` points its entry points (``core_rl.advantage_estimators: rank_advantage``,
``core_rl.rewards: keyword_reward``, ``core_rl.loops: prompt_lm`` and ``core_rl.workflows:
second_try``) at this module. core-rl imports it the first time a configuration selects one of
these names (or when ``core-rl plugins`` lists everything) and calls every hook implemented here,
so every name gets registered at once.

Registration imports no torch: the config classes come from a torch-free module and the advantage
estimator, which needs torch, is imported by its factory when a run builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core_rl.hookspecs import Register, hookimpl

from core_rl_example_plugin.config import KeywordRewardConfig, PromptLMConfig, RankAdvantageConfig, SecondTryConfig
from core_rl_example_plugin.reward import KeywordReward

if TYPE_CHECKING:
    from core_rl.interfaces import AdvantageEstimator, TrainingLoop
    from core_rl.rollout import RolloutWorkflow


def make_rank_advantage(config: RankAdvantageConfig) -> AdvantageEstimator:
    """The factory of ``rank_advantage``: ``factory(config)`` with the validated section."""
    from core_rl_example_plugin.advantage import RankAdvantage

    return RankAdvantage(config)


@hookimpl
def core_rl_register_advantage_estimators(register: Register) -> None:
    """Register ``rank_advantage``."""
    register(
        "rank_advantage",
        make_rank_advantage,
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


def make_prompt_lm_loop(cfg: Any, host: Any, *, stop: Any, data_rows: Any, config: PromptLMConfig) -> TrainingLoop:
    """The factory of ``prompt_lm``: ``factory(cfg, host, *, stop, data_rows, config)``."""
    from core_rl_example_plugin.loop import PromptLMLoop

    return PromptLMLoop(cfg, host, stop=stop, data_rows=data_rows, config=config)


@hookimpl
def core_rl_register_loops(register: Register) -> None:
    """Register the ``prompt_lm`` training loop (selected by ``trainer.loop.name``)."""
    register(
        "prompt_lm",
        make_prompt_lm_loop,
        description="Next-token training on the prompt column's text (continued pre-training)",
        config_cls=PromptLMConfig,
    )


def make_second_try(config: SecondTryConfig) -> RolloutWorkflow:
    """The factory of ``second_try``: ``factory(config)`` with the validated section."""
    from core_rl_example_plugin.workflow import SecondTryWorkflow

    return SecondTryWorkflow(config)


@hookimpl
def core_rl_register_workflows(register: Register) -> None:
    """Register the ``second_try`` rollout workflow (selected by ``rollout.workflow.name``)."""
    register(
        "second_try",
        make_second_try,
        description="Two-turn environment: a wrong answer gets feedback and a second try; sets Sample.reward",
        config_cls=SecondTryConfig,
    )
