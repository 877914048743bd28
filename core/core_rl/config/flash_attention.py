"""What a train engine's ``attn_implementation`` of flash-attn asks of the run and of the machine.

Shared by the engines that load Hugging Face models (``fsdp``, ``deepspeed``) so each refuses the
same settings with the same words. Imports neither torch nor flash-attn: config checks run before
either is loaded (``core-rl config validate``)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core_rl.config.checks import EnvironmentContext, SectionContext

#: the flash-attn implementations transformers knows, and the package each needs (CUDA only)
FLASH_ATTENTION = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
#: the dtypes flash-attn computes in (it has no float32 kernels)
FLASH_ATTENTION_DTYPES = ("bfloat16", "float16")


def compute_dtype_problems(
    context: SectionContext, requested: str | None, compute_dtype: str, *, dtype_keys: str, set_key: str
) -> list[str]:
    """A flash-attn ``requested`` (``<engine>.attn_implementation``) with a forward that computes in
    ``compute_dtype`` float32: one problem naming ``set_key`` (the engine key that makes the forward
    bfloat16); ``dtype_keys`` says in words which settings gave ``compute_dtype``."""
    if requested not in FLASH_ATTENTION or compute_dtype in FLASH_ATTENTION_DTYPES:
        return []
    return [
        f"{context.key('attn_implementation')}: {requested} computes in bfloat16 or float16 only, and this engine's "
        f"forward computes in {compute_dtype} ({dtype_keys}); set {context.key(set_key)}: bfloat16, or use sdpa"
    ]


def machine_problems(context: EnvironmentContext, requested: str | None) -> list[str]:
    """A flash-attn ``requested`` on a machine without CUDA, or without its package."""
    package = FLASH_ATTENTION.get(requested or "")
    if package is None:
        return []
    key = context.key("attn_implementation")
    if not context.machine.cuda_available:
        return [f"{key}: {requested} needs a CUDA GPU and this machine has none; use sdpa"]
    if importlib.util.find_spec(package) is None:
        return [f"{key}: {requested} needs the {package} package, which is not installed; install it or use sdpa"]
    return []
