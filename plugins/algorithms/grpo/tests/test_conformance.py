"""The core-rl conformance contracts, for every component this distribution registers."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_grpo.plugin as grpo_plugin
from core_rl.testing import (
    AdvantageEstimatorContract,
    AlgorithmContract,
    PolicyLossContract,
    SampleFilterContract,
)

DIST = "core-rl-grpo"


class TestGRPOAdvantage(AdvantageEstimatorContract):
    plugin = grpo_plugin
    name = "grpo"
    distribution = DIST


class TestGRPOLeaveOneOutAdvantage(AdvantageEstimatorContract):
    plugin = grpo_plugin
    name = "grpo"
    options: ClassVar[dict[str, Any]] = {"leave_one_out": True, "norm_std": False}
    distribution = DIST


class TestRLOOAdvantage(AdvantageEstimatorContract):
    plugin = grpo_plugin
    name = "rloo"
    distribution = DIST


class TestPPOClipLoss(PolicyLossContract):
    plugin = grpo_plugin
    name = "ppo_clip"
    distribution = DIST


class TestPPOClipLossAllTerms(PolicyLossContract):
    plugin = grpo_plugin
    name = "ppo_clip"
    options: ClassVar[dict[str, Any]] = {
        "eps_clip_higher": 0.28,
        "dual_clip": 3.0,
        "aggregation": "seq-mean-token-sum-norm",
        "norm_length": 8,
        "kl_coef": 0.05,
        "kl_estimator": "k2",
        "entropy_coef": 0.01,
    }
    distribution = DIST


class TestPPOClipLossSeqMean(PolicyLossContract):
    plugin = grpo_plugin
    name = "ppo_clip"
    options: ClassVar[dict[str, Any]] = {"aggregation": "seq-mean-token-mean", "kl_coef": 0.1}
    distribution = DIST


class TestDropUniformGroups(SampleFilterContract):
    plugin = grpo_plugin
    name = "drop_uniform_groups"
    distribution = DIST


class TestGRPOAlgorithm(AlgorithmContract):
    plugin = grpo_plugin
    name = "grpo"
    distribution = DIST
