"""Loading a Hugging Face causal LM and sharding it with FSDP2 (``fully_shard``)."""

from __future__ import annotations

import torch
from core_rl.config.schema import ActorConfig
from core_rl.engine_utils import hf
from core_rl.engine_utils.hf import torch_dtype
from torch import nn

from core_rl_fsdp.config import FSDPConfig

try:  # torch >= 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def load_causal_lm(actor: ActorConfig, config: FSDPConfig) -> nn.Module:
    """``actor.model_path`` in ``actor.dtype`` on CPU (see :func:`core_rl.engine_utils.hf.load_causal_lm`);
    ``fully_shard`` moves each rank's shard to the mesh's device."""
    return hf.load_causal_lm(actor.model_path, dtype=actor.dtype, attn_implementation=config.attn_implementation)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant ``torch.utils.checkpoint``),
    through transformers' own switch (``activation_checkpointing_enable`` from transformers 5.23,
    ``gradient_checkpointing_enable`` before). Call before :func:`shard_model`."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def shard_units(model: nn.Module, wrap: str) -> list[nn.Module]:
    """The submodules that become their own FSDP unit before the root, innermost first.

    ``decoder_layers``: every module whose class the model lists in ``_no_split_modules`` (for
    decoder-only LMs, the decoder layer), in reverse module order so a nested unit is sharded
    before the unit that contains it. ``root``: none.
    """
    if wrap == "root":
        return []
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not units:
        raise ValueError(
            f"{type(model).__name__} lists no decoder-layer classes in _no_split_modules; "
            "set actor.engine.wrap: root to shard it as one unit"
        )
    return units[::-1]


def shard_model(model: nn.Module, mesh: object, config: FSDPConfig, device: torch.device) -> nn.Module:
    """Apply ``fully_shard`` to each unit of :func:`shard_units`, then to the root, with the
    mixed-precision and offload policies of ``config``; returns ``model`` (now an ``FSDPModule``)."""
    kwargs: dict[str, object] = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward}
    if config.param_dtype is not None or config.reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch_dtype(config.param_dtype) if config.param_dtype else None,
            reduce_dtype=torch_dtype(config.reduce_dtype) if config.reduce_dtype else None,
        )
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for unit in shard_units(model, config.wrap):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model
