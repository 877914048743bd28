"""The DeepSpeed configuration (the dict ``deepspeed.initialize`` takes) for an actor and engine options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core_rl.config.schema import ActorConfig

from core_rl_deepspeed.config import DeepSpeedConfig


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in recursively (mappings merge, everything else replaces)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def build_ds_config(actor: ActorConfig, options: DeepSpeedConfig, *, on_cuda: bool) -> dict[str, Any]:
    """The DeepSpeed configuration of an engine.

    The engine owns the training loop's semantics, so DeepSpeed is told to stay out of them:
    ``managed_gradient_accumulation: false`` (every ``backward`` accumulates, every ``step`` is one
    optimizer step, whatever the number of micro-batches), no DeepSpeed scheduler (the engine sets
    ``lr_at(step)`` itself), gradient clipping at ``actor.grad_clip`` (0: none), the engine's own
    torch optimizer accepted with offload (``zero_force_ds_cpu_optimizer: false``: no fused CPU
    Adam to compile). ``options.config_overrides`` is merged last.
    """
    zero: dict[str, Any] = {
        "stage": options.zero_stage,
        "overlap_comm": options.overlap_comm,
        "contiguous_gradients": True,
        "reduce_bucket_size": options.reduce_bucket_size,
    }
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
    if options.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(actor.grad_clip),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if options.mixed_precision == "bfloat16" or (options.mixed_precision is None and actor.dtype == "bfloat16"):
        # bf16 weights too: only in its bf16 mode does DeepSpeed's ZeRO-1/2 skip a step whose
        # gradients are not finite (its overflow check; without it clipping writes NaN everywhere)
        config["bf16"] = {"enabled": True}
    elif options.mixed_precision == "float16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return _merge(config, options.config_overrides)
