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


@pytest.mark.parametrize(
    ("bf16", "dtype", "master_weights"),
    [(False, "float32", False), (True, "float32", True), (False, "bfloat16", True), (True, "bfloat16", True)],
)
def test_bfloat16_parameters_get_float32_master_weights(bf16: bool, dtype: str, master_weights: bool) -> None:
    """Megatron's optimizer for parameters of ``dtype``: bfloat16 parameters, with ``bf16`` or
    loaded as ``actor.dtype: bfloat16``, get float32 masters (Megatron's float32 optimizer would
    assign float32 gradients to bfloat16 parameters, which torch refuses on a GPU)."""
    import torch
    from core_rl.config.schema import OptimizerConfig
    from core_rl_megatron.optim import optimizer_config

    conf = optimizer_config(OptimizerConfig(), MegatronConfig(bf16=bf16), 1.0, getattr(torch, dtype))
    assert conf.bf16 is master_weights and not conf.fp16
    assert conf.params_dtype == (torch.bfloat16 if master_weights else torch.float32)


def test_float16_parameters_are_refused_naming_the_setting() -> None:
    import torch
    from core_rl.config.schema import OptimizerConfig
    from core_rl_megatron.errors import MegatronSetupError
    from core_rl_megatron.optim import optimizer_config

    with pytest.raises(MegatronSetupError, match="actor.dtype: float16 on the megatron engine trains without loss"):
        optimizer_config(OptimizerConfig(), MegatronConfig(), 1.0, torch.float16)
