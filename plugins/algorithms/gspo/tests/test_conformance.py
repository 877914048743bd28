"""The core-rl conformance contract for the ``gspo`` recipe."""

from __future__ import annotations

import core_rl_gspo.plugin as gspo_plugin
from core_rl.testing import AlgorithmContract, installed_distribution


class TestGSPOAlgorithm(AlgorithmContract):
    plugin = gspo_plugin
    name = "gspo"
    distribution = installed_distribution("core-rl-gspo")
