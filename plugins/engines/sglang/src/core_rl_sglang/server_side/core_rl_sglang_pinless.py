"""Pinned host memory made ordinary memory, in an SGLang server on a CPU-only torch.

This file runs in the sglang server environment (:mod:`sitecustomize` next to it applies it in every
process of a server the engine starts with ``CORE_RL_SGLANG_PINLESS=1``: the server's own and any
process SGLang spawns). SGLang 0.5.23's LoRA layers (``sglang/srt/lora/layers.py``) and its
``torch_native`` LoRA backend (``sglang/srt/lora/backend/torch_backend.py``) create host tensors
with ``pin_memory=True`` or ``.pin_memory()`` whatever the device, and a CPU-only torch has no
pinned-memory allocator: the server fails at start with ``RuntimeError: pin_memory=True requires a
CUDA or other accelerator backend``. Pinning only speeds up copies to an accelerator, of which a CPU
server has none, so those tensors are made as ordinary ones. Its routed-experts capture
(``--enable-return-routed-experts``) registers a host buffer with ``cudaHostRegister`` through
``torch.cuda.cudart()``, which fails on a CPU-only torch: there, registering host memory succeeds
doing nothing (:class:`NoCudaRuntime`). Nothing changes where pinning works.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

#: the torch factories SGLang's LoRA code passes ``pin_memory`` to
FACTORIES = ("tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange")


def pinning_works(torch: Any) -> bool:
    """Whether this torch can pin host memory."""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


def _without_pin(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return make


class NoCudaRuntime:
    """``torch.cuda.cudart()`` on a CPU-only torch: host-memory registration (which only speeds up
    copies to a device) succeeds and does nothing."""

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:
        return 0

    def cudaGetErrorString(self, code: int) -> str:
        return f"CUDA error {code} (no CUDA in this torch)"


def apply() -> bool:
    """Make pinned host tensors ordinary ones where this torch cannot pin; whether it did."""
    import torch

    if pinning_works(torch):
        return False
    for name in FACTORIES:
        setattr(torch, name, _without_pin(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    if not torch.cuda.is_available():
        torch.cuda.cudart = NoCudaRuntime
    print("core-rl: no pinned memory on this torch; SGLang's pinned host tensors are ordinary ones", file=sys.stderr)
    return True
