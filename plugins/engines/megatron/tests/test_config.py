"""The ``actor.engine`` section: defaults, Megatron's names, and each invalid combination reported
with its key."""

from __future__ import annotations

import pytest
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl_megatron.config import DDPConfig, MegatronConfig


def test_defaults_and_megatron_names() -> None:
    assert structure({}, MegatronConfig) == MegatronConfig()
    cfg = structure(
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 4,
            "virtual_pipeline_model_parallel_size": 2,
            "sequence_parallel": True,
            "recompute_granularity": "full",
            "recompute_method": "block",
            "recompute_num_layers": 3,
            "ddp": {"use_distributed_optimizer": True, "overlap_param_gather": True, "bucket_size": 1000},
        },
        MegatronConfig,
    )
    assert (cfg.model_parallel_size, cfg.virtual_pipeline_size) == (8, 2)
    assert cfg.ddp == DDPConfig(use_distributed_optimizer=True, overlap_param_gather=True, bucket_size=1000)


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual_pipeline_model_parallel_size"),
        ({"sequence_parallel": True}, "sequence_parallel"),
        ({"context_parallel_size": 2}, "context_parallel_size"),
        ({"recompute_granularity": "full"}, "recompute_granularity"),
        ({"recompute_method": "uniform"}, "recompute_method"),
        ({"recompute_granularity": "selective", "recompute_num_layers": 2}, "recompute_num_layers"),
        ({"recompute_modules": ["core_attn"]}, "recompute_modules"),
        ({"recompute_granularity": "partial"}, "recompute_granularity"),
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size"),
        ({"transformer_impl": "apex"}, "transformer_impl"),
        ({"ddp": {"overlap_param_gather": True}}, "ddp.overlap_param_gather"),
        ({"ddp": {"bucket_size": 0}}, "ddp.bucket_size"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_invalid_combinations_name_their_key(section: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        structure(section, MegatronConfig, path="actor.engine")
    assert f"actor.engine.{key}" in str(info.value)
