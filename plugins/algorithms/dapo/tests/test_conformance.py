"""The core-rl conformance contract for the ``dapo`` recipe."""

from __future__ import annotations

import core_rl_dapo.plugin as dapo_plugin
from core_rl.testing import AlgorithmContract, installed_distribution


class TestDAPOAlgorithm(AlgorithmContract):
    plugin = dapo_plugin
    name = "dapo"
    distribution = installed_distribution("core-rl-dapo")
