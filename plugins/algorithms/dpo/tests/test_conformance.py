"""The core-rl conformance contracts for the ``dpo`` and ``kto`` loops and the ``dpo`` / ``ipo`` / ``simpo`` /
``orpo`` / ``kto`` recipes."""

from __future__ import annotations

import core_rl_dpo.plugin as dpo_plugin
from core_rl.testing import AlgorithmContract, LoopContract, installed_distribution


class TestDPOLoop(LoopContract):
    plugin = dpo_plugin
    name = "dpo"
    distribution = installed_distribution("core-rl-dpo")


class TestDPOAlgorithm(AlgorithmContract):
    plugin = dpo_plugin
    name = "dpo"
    distribution = installed_distribution("core-rl-dpo")


class TestIPOAlgorithm(AlgorithmContract):
    plugin = dpo_plugin
    name = "ipo"
    distribution = installed_distribution("core-rl-dpo")


class TestSimPOAlgorithm(AlgorithmContract):
    plugin = dpo_plugin
    name = "simpo"
    distribution = installed_distribution("core-rl-dpo")


class TestORPOAlgorithm(AlgorithmContract):
    plugin = dpo_plugin
    name = "orpo"
    distribution = installed_distribution("core-rl-dpo")


class TestKTOLoop(LoopContract):
    plugin = dpo_plugin
    name = "kto"
    distribution = installed_distribution("core-rl-dpo")


class TestKTOAlgorithm(AlgorithmContract):
    plugin = dpo_plugin
    name = "kto"
    distribution = installed_distribution("core-rl-dpo")
