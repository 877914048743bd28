"""The core-rl conformance kit for train engines, run against ``deepspeed`` ZeRO-3 (one process, CPU):
the stage that partitions parameters, so gathering, exporting and resuming are all exercised
(stages 1 and 2 are checked against FSDP by ``tests/test_engine_parity.py``)."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_deepspeed.plugin
from core_rl.testing import TrainEngineContract, installed_distribution


class TestDeepSpeedZero3Contract(TrainEngineContract):
    plugin = core_rl_deepspeed.plugin
    name = "deepspeed"
    options: ClassVar[dict[str, Any]] = {"zero_stage": 3}
    distribution = installed_distribution("core-rl-deepspeed")
