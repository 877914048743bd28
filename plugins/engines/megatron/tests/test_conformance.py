"""The core-rl conformance kit for train engines, run against ``megatron`` (one process, CPU, with
the test-only CUDA shim of ``conftest.py``)."""

from __future__ import annotations

from typing import ClassVar

import core_rl_megatron.plugin
from core_rl.testing import TrainEngineContract, installed_distribution


class TestMegatronEngineContract(TrainEngineContract):
    plugin = core_rl_megatron.plugin
    name = "megatron"
    distribution = installed_distribution("core-rl-megatron")
    options: ClassVar[dict] = {"make_vocab_size_divisible_by": 8}
