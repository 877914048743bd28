"""Building the model of an FSDP engine: load a Hugging Face causal LM (on rank 0 only, when asked),
add LoRA adapters and activation checkpointing, and shard it with FSDP2 (``fully_shard``)."""

from __future__ import annotations

import torch
from core_rl.config.schema import ActorConfig
from core_rl.launch import distributed as dist_utils
from core_rl.roles import hf
from core_rl.roles.hf import torch_dtype
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from core_rl_fsdp.config import FSDPConfig

try:  # torch >= 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import (  # noqa: F401  (FSDPModule: for the engine)
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )


def build_model(
    actor: ActorConfig,
    config: FSDPConfig,
    *,
    trainable: bool,
    mesh: object,
    device: torch.device,
    rank: int,
    world_size: int,
    attn_implementation: str | None,
    head: str = "lm",
) -> nn.Module:
    """The sharded model (an ``FSDPModule``) of ``actor``: a causal LM, or with ``head="value"`` a
    value model (:func:`core_rl.roles.hf.load_value_model`; ``"score"``: without a bias in its head).

    With ``config.load_on_rank0`` and several ranks, only rank 0 reads the weights; the other
    ranks build the model on the ``meta`` device (no memory), shard it, allocate only their shards
    and receive them from rank 0 (``set_model_state_dict(..., broadcast_from_rank0=True)``), plus
    the buffers a state dict leaves out (e.g. rotary frequencies). Otherwise every rank reads the
    full weights into CPU memory before sharding. A trainable model gets LoRA adapters when
    ``actor.lora`` asks (a frozen reference stays the base model) and activation checkpointing
    when ``actor.gradient_checkpointing`` is on.
    """
    from_rank0 = config.load_on_rank0 and world_size > 1
    empty, load = hf.loaders_for_head(head)
    kwargs = {
        "dtype": actor.dtype,
        "attn_implementation": attn_implementation,
        "trust_remote_code": actor.trust_remote_code,
    }
    model = empty(actor.model_path, **kwargs) if from_rank0 and rank != 0 else load(actor.model_path, **kwargs)
    model = hf.prepare_for_role(model, actor, trainable=trainable)
    if not from_rank0:
        return shard_model(model, mesh, config, device)
    full = model.state_dict() if rank == 0 else {}
    extra_buffers = {n: b for n, b in model.named_buffers() if n not in full} if rank == 0 else None
    extra_buffers = dist_utils.broadcast_object(extra_buffers)
    shard_model(model, mesh, config, device)
    model.to_empty(device="cpu" if config.cpu_offload else device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    del full
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in extra_buffers.items():  # type: ignore[union-attr]
            buffers[name].copy_(value)
    return model


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


def needs_fsdp(config: FSDPConfig, world_size: int) -> bool:
    """Whether the model is wrapped with ``fully_shard``: always with several ranks, mixed precision
    or CPU offload (FSDP implements those), else only if ``config.shard_single_rank``."""
    policies = config.param_dtype is not None or config.reduce_dtype is not None or config.cpu_offload
    return world_size > 1 or policies or config.shard_single_rank


def shard_model(model: nn.Module, mesh: object, config: FSDPConfig, device: torch.device) -> nn.Module:
    """Apply ``fully_shard`` to each unit of :func:`shard_units`, then to the root, with the
    mixed-precision and offload policies of ``config``; returns ``model`` (now an ``FSDPModule``).
    Offloaded shards use pinned memory only on CUDA (pinning needs an accelerator). When
    :func:`needs_fsdp` says no (one rank, no policies), the plain module moves to ``device``."""
    world_size = getattr(mesh, "size", lambda: 1)()
    if not needs_fsdp(config, world_size):
        return model.to(device)
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


def compile_model(model: nn.Module, config: FSDPConfig, world_size: int) -> list[nn.Module]:
    """``torch.compile`` (inductor, dynamic shapes) in place, keeping parameter names: the whole
    plain one-rank module, or, when FSDP wraps it, each of its units (:func:`shard_units`, or the
    root for ``wrap: root``) so FSDP's hooks run between compiled graphs. Returns what was compiled."""
    if not needs_fsdp(config, world_size):
        targets = [model]
    else:
        targets = shard_units(model, config.wrap) or [model]
    for target in targets:
        target.compile(dynamic=True)
    return targets
