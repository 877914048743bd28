"""The engine's config section and the DeepSpeed configuration built from it."""

from __future__ import annotations

import pytest
from core_rl.config.loader import structure
from core_rl.config.schema import ActorConfig
from core_rl.errors import ConfigError
from core_rl_deepspeed.config import DeepSpeedConfig
from core_rl_deepspeed.ds_config import build_ds_config


def test_config_section_and_errors() -> None:
    assert structure({}, DeepSpeedConfig) == DeepSpeedConfig()
    cfg = structure({"zero_stage": 3, "offload_param": True, "mixed_precision": "bfloat16"}, DeepSpeedConfig)
    assert (cfg.zero_stage, cfg.offload_param, cfg.mixed_precision) == (3, True, "bfloat16")
    with pytest.raises(ConfigError, match=r"actor\.engine\.zero_stage: must be one of 1, 2, 3, got 4"):
        structure({"zero_stage": 4}, DeepSpeedConfig, path="actor.engine")
    with pytest.raises(ConfigError, match=r"actor\.engine\.offload_param: needs zero_stage: 3"):
        structure({"zero_stage": 2, "offload_param": True}, DeepSpeedConfig, path="actor.engine")
    with pytest.raises(ConfigError, match=r"actor\.engine\.overlap_comm: needs zero_stage 2 or 3"):
        structure({"zero_stage": 1, "overlap_comm": True}, DeepSpeedConfig, path="actor.engine")
    with pytest.raises(ConfigError, match="mixed_precision"):
        structure({"mixed_precision": "int8"}, DeepSpeedConfig, path="actor.engine")


def test_generated_deepspeed_config() -> None:
    actor = ActorConfig(grad_clip=0.5)
    options = DeepSpeedConfig(
        zero_stage=3,
        offload_optimizer=True,
        offload_param=True,
        mixed_precision="bfloat16",
        config_overrides={"zero_optimization": {"stage3_max_live_parameters": 123}, "steps_per_print": 10},
    )
    ds = build_ds_config(actor, options, on_cuda=False)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_max_live_parameters"] == 123  # merged, not replaced
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert build_ds_config(actor, options, on_cuda=True)["zero_optimization"]["offload_param"]["pin_memory"] is True
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["gradient_clipping"] == 0.5 and ds["steps_per_print"] == 10
    # the engine owns accumulation and the schedule: one optimizer step per step() call
    assert ds["managed_gradient_accumulation"] is False and ds["gradient_accumulation_steps"] == 1
    assert "scheduler" not in ds and "optimizer" not in ds
    plain = build_ds_config(ActorConfig(), DeepSpeedConfig(zero_stage=1), on_cuda=False)
    assert "offload_optimizer" not in plain["zero_optimization"] and "bf16" not in plain
