"""The core conformance kit run against real vLLM servers started from the managed ``vllm``
server environment (built on first use: ``core-rl server-env create vllm``)."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_vllm.plugin
from core_rl.testing import ServerRolloutEngineContract, installed_distribution


class TestVLLMRolloutEngine(ServerRolloutEngineContract):
    plugin = core_rl_vllm.plugin
    name = "vllm"
    distribution = installed_distribution("core-rl-vllm")
    options: ClassVar[dict[str, Any]] = {"dtype": "bfloat16", "max_num_seqs": 64}
    tiny_model_options: ClassVar[dict[str, Any]] = {"num_heads": 2}  # vLLM's CPU attention: head size >= 32
    logprob_atol = 2e-2
