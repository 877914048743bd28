"""The core-rl conformance contracts, for every component this distribution registers."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_ppo.plugin as ppo_plugin
from core_rl.testing import AdvantageEstimatorContract, AlgorithmContract

DIST = "core-rl-ppo"


class TestGAEAdvantage(AdvantageEstimatorContract):
    plugin = ppo_plugin
    name = "gae"
    distribution = DIST


class TestGAEAdvantageWithKLInReward(AdvantageEstimatorContract):
    plugin = ppo_plugin
    name = "gae"
    options: ClassVar[dict[str, Any]] = {"discount": 0.99, "gae_lambda": 0.9, "kl_ctl": 0.05, "kl_estimator": "k3"}
    distribution = DIST


class TestPPOAlgorithm(AlgorithmContract):
    plugin = ppo_plugin
    name = "ppo"
    distribution = DIST


class TestDistillAlgorithm(AlgorithmContract):
    plugin = ppo_plugin
    name = "distill"
    distribution = DIST
