"""Which attention implementation the fsdp engine loads its model with."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from core_rl.roles.hf import resolve_attn_implementation
from core_rl_train_kit.attention import NAME, register, sdpa_float32_attention

if TYPE_CHECKING:
    from core_rl_fsdp.config import FSDPConfig

__all__ = ["NAME", "resolve", "sdpa_float32_attention"]


def resolve(config: FSDPConfig, device: torch.device, compute_dtype: str) -> str | None:
    """The attention implementation to load the model with: ``config.attn_implementation`` as
    :func:`~core_rl.roles.hf.resolve_attn_implementation` resolves it for ``compute_dtype``
    (:meth:`FSDPConfig.compute_dtype`), except that ``auto`` with ``autocast_dtype`` on a CPU is
    :data:`NAME` (:mod:`core_rl_train_kit.attention`); :data:`NAME` is registered when chosen."""
    attn = resolve_attn_implementation(config.attn_implementation, device, compute_dtype)
    if config.attn_implementation == "auto" and config.autocast_dtype is not None and device.type == "cpu":
        attn = NAME
    if attn == NAME:
        register()
    return attn
