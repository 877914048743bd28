"""The core-rl conformance contracts for the ``rm`` loop and recipe."""

from __future__ import annotations

import core_rl_rm.plugin as rm_plugin
from core_rl.testing import AlgorithmContract, LoopContract, installed_distribution


class TestRMLoop(LoopContract):
    plugin = rm_plugin
    name = "rm"
    distribution = installed_distribution("core-rl-rm")


class TestRMAlgorithm(AlgorithmContract):
    plugin = rm_plugin
    name = "rm"
    distribution = installed_distribution("core-rl-rm")
