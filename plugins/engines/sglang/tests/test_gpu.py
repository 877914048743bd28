"""The conformance kit on a GPU: the ``cuda`` server environment, the model in bfloat16 on the GPU,
and weight sync by collective over NCCL with the server on the second GPU (``weight_sync_backend:
auto`` picks NCCL for a cuda server with ``CUDA_VISIBLE_DEVICES`` of its own); with one GPU, gloo
(NCCL refuses two ranks on one GPU). Skipped without a CUDA GPU."""

from __future__ import annotations

from typing import Any, ClassVar

import core_rl_sglang.plugin
import pytest
import torch
from core_rl.testing import ServerRolloutEngineContract, installed_distribution

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() > 1
NCCL: dict[str, Any] = {"weight_sync_backend": "nccl", "env": {"CUDA_VISIBLE_DEVICES": "1"}}
SERVER_PLACEMENT: dict[str, Any] = NCCL if TWO_GPUS else {"weight_sync_backend": "gloo"}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class TestSGLangOnGPU(ServerRolloutEngineContract):
    plugin = core_rl_sglang.plugin
    name = "sglang"
    distribution = installed_distribution("core-rl-sglang")
    # NCCL needs the trainer (cuda:0) and the server on different GPUs; on one GPU the weights go over gloo
    options: ClassVar[dict[str, Any]] = {"dtype": "bfloat16", "server": {"env_variant": "cuda", **SERVER_PLACEMENT}}
    tiny_model_options: ClassVar[dict[str, Any]] = {"num_heads": 2}
    logprob_atol = 2e-2
