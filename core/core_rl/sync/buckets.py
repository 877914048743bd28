"""Weights in buckets, for :meth:`core_rl.interfaces.TrainEngine.hf_weight_buckets`: named tensors
grouped, in order, into dicts of about a given size, so a consumer (a rollout engine copying them
into its own parameters) never needs a second full copy of the model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from core_rl.roles import lora


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes the tensors' elements take."""
    return sum(t.numel() * t.element_size() for t in tensors)


def bucketed(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, keep: bool = True
) -> Iterator[dict[str, torch.Tensor]]:
    """``named`` (name, tensor) pairs in order, as dicts closed once they hold ``bucket_bytes`` or
    more (a tensor larger than that fills a bucket alone); the last may be smaller. With ``keep``
    false (a rank other than the main one, which draws ``named`` only for the collectives inside it)
    every tensor is dropped at once and the buckets are empty, yielded at the same points."""
    bucket: dict[str, torch.Tensor] = {}
    size, pending = 0, False
    for name, tensor in named:
        if keep:
            bucket[name] = tensor
        size += tensor.numel() * tensor.element_size()
        pending = True
        del tensor  # a bucket handed out is the consumer's alone while the next tensor is gathered
        if size >= bucket_bytes:
            yield bucket
            bucket, size, pending = {}, 0, False
    if pending:
        yield bucket


def state_items(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.state_dict()``'s entries without building it: every parameter under each of its
    names (tied ones included) and every persistent buffer, the tensors themselves (not detached
    views). No state-dict hook runs (an FSDP-wrapped module must be resharded first). A weight sync
    draws these every step, and ``state_dict()``'s hooks and per-tensor ``detach`` cost more than
    the copies of a small model on a GPU."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        base = f"{prefix}." if prefix else ""
        for name, param in owner._parameters.items():
            if param is not None:
                yield base + name, param
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                yield base + name, buffer


def tied_sources(model: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for every name under which ``model`` holds a parameter it already
    holds under an earlier name (tied weights, e.g. an output head tied to the input embedding:
    ``{"lm_head.weight": "model.embed_tokens.weight"}``). Decided from the module alone, so every
    rank decides the same."""
    first: dict[int, str] = {}
    sources: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            sources[name] = first[id(param)]
        else:
            first[id(param)] = name
    return sources


def tied_aliases(model: nn.Module) -> set[str]:
    """The aliases of :func:`tied_sources`: every rank skips the same names (and draws the same
    collectives); a receiver counts a tied name as given with its twin."""
    return set(tied_sources(model))


def hf_buckets(
    model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, main: bool
) -> Iterator[dict[str, torch.Tensor]]:
    """A train engine's :meth:`~core_rl.interfaces.TrainEngine.hf_weight_buckets` from ``named``, the
    full state dict of its ``model`` as wrapped, drawn lazily on every rank (collectives inside):
    :func:`bucketed`, kept on the ``main`` rank. With LoRA adapters each adapted weight is merged as
    soon as its adapter has been drawn (:func:`core_rl.roles.lora.merged_items`: about one
    layer held, never the whole model); other ranks draw the same pairs, for the gathers inside."""
    if lora.is_lora_model(model):
        if not main:
            yield from bucketed(named, bucket_bytes, keep=False)
            return
        config = model.peft_config[lora.ADAPTER]
        named = lora.merged_items(
            named,
            adapted=lora.adapted_modules(model),
            scaling=lora.lora_scaling(model),
            fan_in_fan_out=bool(config.fan_in_fan_out),
        )
    yield from bucketed(named, bucket_bytes, keep=main)
