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
        "c_clip": 3.0,
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


class TestReinforcePPAdvantage(AdvantageEstimatorContract):
    plugin = grpo_plugin
    name = "reinforce_pp"
    distribution = DIST


class TestReinforcePPBaselineAdvantage(AdvantageEstimatorContract):
    plugin = grpo_plugin
    name = "reinforce_pp"
    options: ClassVar[dict[str, Any]] = {"group_baseline": True, "gamma": 0.9}
    distribution = DIST


class TestPPOClipLossDecoupledSequence(PolicyLossContract):
    plugin = grpo_plugin
    name = "ppo_clip"
    options: ClassVar[dict[str, Any]] = {
        "importance_sampling_level": "sequence",
        "aggregation": "seq-mean-token-mean",
        "use_decoupled_loss": True,
        "prox_logp_method": "loglinear",
        "off_policy_mask_threshold": 0.1,
    }
    distribution = DIST


class TestPPOClipLossSapo(PolicyLossContract):
    plugin = grpo_plugin
    name = "ppo_clip"
    options: ClassVar[dict[str, Any]] = {"use_sapo_loss": True, "sapo_tau_pos": 0.5}
    distribution = DIST


class TestPPOClipLossCispo(PolicyLossContract):
    plugin = grpo_plugin
    name = "ppo_clip"
    options: ClassVar[dict[str, Any]] = {"use_cispo_loss": True, "cispo_eps_high": 0.5, "use_decoupled_loss": True}
    distribution = DIST


class TestPPOClipLossGmpo(PolicyLossContract):
    plugin = grpo_plugin
    name = "ppo_clip"
    options: ClassVar[dict[str, Any]] = {"use_gmpo_loss": True, "gmpo_eps_low": 0.3, "kl_coef": 0.1}
    distribution = DIST


class TestDrGRPOAlgorithm(AlgorithmContract):
    plugin = grpo_plugin
    name = "dr_grpo"
    distribution = DIST


class TestRLOOAlgorithm(AlgorithmContract):
    plugin = grpo_plugin
    name = "rloo"
    distribution = DIST


class TestReinforcePPAlgorithm(AlgorithmContract):
    plugin = grpo_plugin
    name = "reinforce_pp"
    distribution = DIST
