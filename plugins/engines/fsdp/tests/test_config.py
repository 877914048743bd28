"""The engine's config section and backend resolution."""

from __future__ import annotations

import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl_fsdp.config import FSDPConfig
from core_rl_fsdp.distributed import resolve_backend


def test_config_section() -> None:
    assert structure({}, FSDPConfig) == FSDPConfig()
    cfg = structure({"wrap": "root", "param_dtype": "bfloat16", "cpu_offload": True}, FSDPConfig)
    assert (cfg.wrap, cfg.param_dtype, cfg.cpu_offload) == ("root", "bfloat16", True)
    with pytest.raises(ConfigError, match="param_dtype"):
        structure({"param_dtype": "int8"}, FSDPConfig, path="actor.engine")
    with pytest.raises(ConfigError, match="backend"):
        structure({"backend": "mpi"}, FSDPConfig, path="actor.engine")


def test_backend_resolution() -> None:
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
    assert resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError, match="nccl needs CUDA"):
        resolve_backend("nccl", torch.device("cpu"))
