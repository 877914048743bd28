"""The core-rl conformance kit for train engines, run against ``fsdp`` (one process, CPU)."""

from __future__ import annotations

import core_rl_fsdp.plugin
from core_rl.testing import TrainEngineContract


class TestFSDPEngineContract(TrainEngineContract):
    plugin = core_rl_fsdp.plugin
    name = "fsdp"
    distribution = "core-rl-fsdp"
