"""The core-rl conformance contracts for the ``sft`` loop and recipe."""

from __future__ import annotations

import core_rl_sft.plugin as sft_plugin
from core_rl.testing import AlgorithmContract, LoopContract, installed_distribution


class TestSFTLoop(LoopContract):
    plugin = sft_plugin
    name = "sft"
    distribution = installed_distribution("core-rl-sft")


class TestSFTAlgorithm(AlgorithmContract):
    plugin = sft_plugin
    name = "sft"
    distribution = installed_distribution("core-rl-sft")
