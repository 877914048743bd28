"""Shared fixtures for the cross-package tests."""

from __future__ import annotations

import attrs
import pytest
from core_rl.config.validators import in_range, positive
from core_rl.hookspecs import Register, hookimpl
from core_rl.interfaces import AlgorithmRecipe, Reward
from core_rl.plugins.host import PluginHost


@attrs.define
class ConstantRewardConfig:
    value: float = 1.0
    scale: float = attrs.field(default=1.0, validator=positive())


class ConstantReward(Reward):
    def __init__(self, config: ConstantRewardConfig) -> None:
        self.config = config

    def score(self, items):
        return [self.config.value * self.config.scale for _ in items]


@attrs.define
class ThresholdRewardConfig:
    scale: float = attrs.field(default=1.0, validator=positive())
    cutoff: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))


class InlinePlugin:
    """A plugin defined in a test: a reward with options and an algorithm recipe."""

    @hookimpl
    def core_rl_register_rewards(self, register: Register) -> None:
        register("constant", ConstantReward, description="Always the same score", config_cls=ConstantRewardConfig)
        register("zero", lambda config: ConstantReward(ConstantRewardConfig(value=0.0)), description="Always 0")
        register("threshold", lambda config: None, description="test reward", config_cls=ThresholdRewardConfig)

    @hookimpl
    def core_rl_register_sample_filters(self, register: Register) -> None:
        register("zero_filter", lambda config: None, description="test filter")

    @hookimpl
    def core_rl_register_algorithms(self, register: Register) -> None:
        register(
            "recipe",
            lambda: AlgorithmRecipe(
                defaults={
                    "algorithm": {"advantage": {"name": "adv"}, "loss": {"name": "loss"}},
                    "rollout": {"sampling": {"n": 4, "temperature": 0.9}},
                    "reward": {"name": "constant", "scale": 2.0},
                }
            ),
            description="A test recipe",
        )

    @hookimpl
    def core_rl_register_advantage_estimators(self, register: Register) -> None:
        register("adv", lambda config: None, description="test advantage")

    @hookimpl
    def core_rl_register_policy_losses(self, register: Register) -> None:
        register("loss", lambda config: None, description="test loss")

    @hookimpl
    def core_rl_register_train_engines(self, register: Register) -> None:
        register("eng", lambda *a, **k: None, description="test engine")

    @hookimpl
    def core_rl_register_rollout_engines(self, register: Register) -> None:
        register("gen", lambda *a, **k: None, description="test rollout engine")


@pytest.fixture
def host() -> PluginHost:
    """A host with the installed entry points plus :class:`InlinePlugin`."""
    h = PluginHost(environ={})
    h.register_plugin(InlinePlugin(), distribution="test-inline", version="9.9")
    return h


@pytest.fixture
def minimal_config() -> dict:
    """A complete config selecting only the inline plugin's components."""
    return {
        "actor": {"model_path": "/models/tiny", "engine": {"name": "eng"}},
        "rollout": {"engine": {"name": "gen"}},
        "algorithm": {"name": "recipe"},
        "reward": {"name": "constant", "value": 0.5},
        "data": {"train_files": ["prompts.jsonl"]},
        "loggers": [{"name": "jsonl"}],
    }
