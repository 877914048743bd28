"""Keeping a sharded vision tower's collectives in step across ranks.

With FSDP (and DeepSpeed ZeRO-3) the vision tower's blocks are sharded units whose weights every
rank gathers when the tower runs; under ZeRO 1 and 2 every rank reduces the tower's gradients. A
micro-batch without images (text-only rows, or the placeholder a rank runs when it has no rows
left) does not run the tower, so on several ranks one rank would gather the tower's weights while
another gathers the next layer's: a collective mismatch. :func:`idle_vision_pass` runs the tower
over one blank image (zeros, the smallest grid the tower takes: ``1 x merge x merge`` patches) and
returns ``0 * sum(features)``, which the caller adds to its output: the values are unchanged, every
rank runs the same collectives, and the tower's gradients get a zero contribution. It runs inside
the model's forward, just before the language model (:func:`idle_vision_pass`), the order in which
a forward with images runs the tower (ZeRO-3 also checks that every rank starts its modules in the
same order). A model wrapped by an engine (DeepSpeed, peft) is looked into
(:func:`core_rl.roles.hf.inner_model`).

It applies to vision-language models with ``get_image_features`` whose ``config.vision_config``
names ``image_size`` and ``num_channels`` (a tower over whole images: LLaVA, Gemma 3), or
``patch_size``, ``temporal_patch_size``, ``in_channels`` and ``spatial_merge_size`` (patch rows and
a grid: the Qwen2-VL family); elsewhere, and on a single rank, it does nothing (nothing to keep in
step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from core_rl.roles.hf import inner_model
from torch import nn


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def blank_image_inputs(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor] | None:
    """The pixel inputs of one blank image (zeros) for ``model``'s tower: a whole image of the
    tower's ``image_size``, or the patch rows and ``image_grid_thw`` of the smallest grid; ``None``
    when its config says neither layout."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    whole = ("image_size", "num_channels")  # a tower over whole images (CLIP, SigLIP: LLaVA, Gemma 3)
    if vision is not None and all(isinstance(getattr(vision, n, None), int) for n in whole):
        side = vision.image_size
        return {"pixel_values": torch.zeros((1, vision.num_channels, side, side), device=device)}
    names = ("patch_size", "temporal_patch_size", "in_channels", "spatial_merge_size")
    if vision is None or not all(isinstance(getattr(vision, n, None), int) for n in names):
        return None
    merge = vision.spatial_merge_size
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return {
        "pixel_values": torch.zeros((merge * merge, width), device=device),
        "image_grid_thw": torch.tensor([[1, merge, merge]], device=device),
    }


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif hasattr(value, "to_tuple"):  # a transformers ModelOutput
        yield from _tensors(value.to_tuple())


def _features_term(model: nn.Module, device: torch.device) -> torch.Tensor:
    inputs = blank_image_inputs(model, device)
    assert inputs is not None
    features = model.get_image_features(**inputs)
    # what reaches the language model (transformers puts the projected features in pooler_output):
    # the tower's other outputs may come from layers a forward with images never back-propagates
    # through (LLaVA's last CLIP layer, vision_feature_layer -2), and every rank's backward must
    # reach the same units
    pooled = getattr(features, "pooler_output", None)
    terms = [t.float().sum() for t in _tensors(features if pooled is None else pooled) if t.is_floating_point()]
    return torch.stack(terms).sum() * 0.0


@contextlib.contextmanager
def idle_vision_pass(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Within it, a forward of ``model`` without images runs the tower over a blank image first and
    adds ``0 * sum(features)`` to the language model's hidden states (module docstring): hooks on
    the language model (``model.get_decoder()``), so the root's forward (FSDP2's root unit) starts
    first, as it does with images. Nothing on one rank or for a model this does not apply to."""
    model = inner_model(model)  # an engine's wrapper (DeepSpeed's has a config of its own, peft's)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    applies = (
        _several_ranks()
        and decoder is not None
        and hasattr(model, "get_image_features")
        and blank_image_inputs(model, device) is not None
    )
    if not applies:
        yield
        return
    held: list[torch.Tensor] = []

    def before(_module: nn.Module, _args: Any) -> None:
        held.append(_features_term(model, device))

    def after(_module: nn.Module, _args: Any, output: Any) -> Any:
        term = held.pop()
        output["last_hidden_state"] = output["last_hidden_state"] + term.to(output["last_hidden_state"].dtype)
        return output

    # first among the decoder's pre-hooks: ZeRO-3 records the order modules start in and wants it the
    # same on every rank, and with images the tower runs before the decoder's own hooks
    handles = [decoder.register_forward_pre_hook(before, prepend=True), decoder.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
