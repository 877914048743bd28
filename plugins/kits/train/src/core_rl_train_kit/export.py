"""A train engine's ``export_hf``: the model as a Hugging Face directory (merged weights, plus the
LoRA adapter alone where there is one), and its ``export_adapter``: the adapter alone; each written
by rank 0 while every rank waits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from core_rl.launch import distributed as dist_utils
from core_rl.roles.hf import write_hf_dir
from core_rl.roles.lora import base_model, hf_state_dict, is_lora_model, write_adapter_dir
from torch import nn


def export_model_dir(
    final: Path,
    model: nn.Module,
    wrapped_state: dict[str, torch.Tensor],
    *,
    rank: int,
    architectures: list[str],
    tokenizer_path: str,
    model_path: str | None = None,
    trust_remote_code: bool = False,
) -> None:
    """``export_hf`` of a train engine, called by every rank with the model's full state dict
    (``wrapped_state``: complete on rank 0): rank 0 writes ``final`` as a Hugging Face directory
    (merged weights with LoRA, plus the adapter alone in ``final/adapter``), atomically; every rank
    waits for it and raises if it failed. ``model_path`` (the directory the model was loaded from)
    and ``trust_remote_code``: see :func:`~core_rl.roles.hf.write_hf_dir`."""

    def write() -> None:
        write_hf_dir(
            final,
            base_model(model),
            hf_state_dict(model, wrapped_state),
            architectures=architectures,
            tokenizer_path=tokenizer_path,
            model_path=model_path,
            trust_remote_code=trust_remote_code,
        )
        if is_lora_model(model):
            write_adapter_dir(final / "adapter", model, wrapped_state)

    _on_main(rank, write)


def export_adapter_dir(final: Path, model: nn.Module, adapter_state: dict[str, torch.Tensor], *, rank: int) -> None:
    """``export_adapter`` of a train engine, called by every rank: rank 0 writes the adapter alone
    to ``final`` from ``adapter_state`` (the wrapped model's ``lora_`` tensors, full, on rank 0:
    :func:`~core_rl.roles.lora.is_adapter_key`) atomically; every rank waits for it and
    raises if it failed, or if ``model`` carries no adapter."""
    if not is_lora_model(model):
        raise ValueError("export_adapter: the model carries no LoRA adapter (actor.lora.rank is 0)")
    _on_main(rank, lambda: write_adapter_dir(final, model, adapter_state))


def _on_main(rank: int, write: Callable[[], None]) -> None:
    """``write()`` on rank 0 while every rank waits at a barrier; its error raised on rank 0 after
    the barrier, so other ranks do not hang."""
    error: BaseException | None = None
    if rank == 0:
        try:
            write()
        except BaseException as exc:
            error = exc
    dist_utils.barrier()
    if error is not None:
        raise error
