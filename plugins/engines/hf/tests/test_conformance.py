"""The core conformance kit run against the ``hf`` rollout engine."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_hf.plugin
from core_rl.testing import RolloutEngineContract


class TestHFRolloutEngine(RolloutEngineContract):
    plugin = core_rl_hf.plugin
    name = "hf"
    distribution = "core-rl-hf"
    options: ClassVar[dict[str, Any]] = {"device": "cpu", "seed": 0}


class TestHFRolloutEngineSmallChunks(RolloutEngineContract):
    """The same contract when every request is split into chunks of 2 sequences."""

    plugin = core_rl_hf.plugin
    name = "hf"
    distribution = "core-rl-hf"
    options: ClassVar[dict[str, Any]] = {"device": "cpu", "max_batch_size": 2}
