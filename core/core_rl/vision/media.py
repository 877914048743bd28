"""Pixel inputs carried row by row in a :class:`~core_rl.protocol.TensorBatch`.

A sample's pixel inputs (:attr:`core_rl.protocol.Sample.media`) are ``pixel_values`` ``[P, ...]``
(its images' patch rows ``[P, D]``, image after image; or whole images ``[I, 3, H, W]``) and
``image_grid_thw`` ``[I, 3]`` (each image's patch grid, ``P = sum(t * h * w)``; ``(1, 1, 1)`` for a
whole image, :mod:`core_rl.vision.prompts`). A batch holds them right-padded per row so that
selecting rows (micro-batching, rank sharding) keeps each row's images with its tokens:

====================  ===============  ===========================================================
key                   shape            meaning
====================  ===============  ===========================================================
``pixel_values``      [B, P_max, ...]  row ``i``'s patch rows (or images) first, then zeros
``image_grid_thw``    [B, I_max, 3]    row ``i``'s image grids first, then zero rows (no image)
====================  ===============  ===========================================================

A row's images are its grid rows whose product is not 0; its patch rows the first
``sum(t * h * w)`` of ``pixel_values``. :func:`row_media` undoes the padding for a model's forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: the batch keys of pixel inputs (the module docstring)
MEDIA_KEYS = ("pixel_values", "image_grid_thw")


def pad_media(media: Sequence[Mapping[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """The batch keys (module docstring) of one row per entry of ``media`` (``None``: a row with no
    images); an empty dict when no row has images."""
    import torch

    present = [m for m in media if m is not None]
    if not present:
        return {}
    trailing = tuple(present[0]["pixel_values"].shape[1:])
    patches = max(m["pixel_values"].shape[0] for m in present)
    images = max(m["image_grid_thw"].shape[0] for m in present)
    pixel_values = torch.zeros((len(media), patches, *trailing), dtype=present[0]["pixel_values"].dtype)
    grid = torch.zeros((len(media), images, 3), dtype=torch.long)
    for i, m in enumerate(media):
        if m is not None:
            pixel_values[i, : m["pixel_values"].shape[0]] = m["pixel_values"]
            grid[i, : m["image_grid_thw"].shape[0]] = m["image_grid_thw"]
    return {"pixel_values": pixel_values, "image_grid_thw": grid}


def row_media(batch: Mapping[str, torch.Tensor], rows: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The unpadded pixel inputs of ``rows`` of ``batch`` (default every row), in row order, as a
    model's forward takes them: ``pixel_values`` ``[sum P_i, D]`` and ``image_grid_thw`` ``[sum I_i, 3]``;
    an empty dict when the batch has no pixel inputs or those rows have no image."""
    import torch

    if "image_grid_thw" not in batch:
        return {}
    grids, pixels = batch["image_grid_thw"], batch["pixel_values"]
    chosen = range(grids.shape[0]) if rows is None else rows
    kept_grids, kept_pixels = [], []
    for i in chosen:
        grid = grids[i][grids[i].prod(dim=-1) > 0]
        if grid.shape[0]:
            kept_grids.append(grid)
            kept_pixels.append(pixels[i, : int(grid.prod(dim=-1).sum())])
    if not kept_grids:
        return {}
    return {"pixel_values": torch.cat(kept_pixels), "image_grid_thw": torch.cat(kept_grids)}


def concat_media(media: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several samples' unpadded pixel inputs as one forward's, in order (empty ones skipped)."""
    import torch

    present = [m for m in media if m]
    if not present:
        return {}
    return {key: torch.cat([m[key] for m in present]) for key in MEDIA_KEYS}


def forward_kwargs(model: Any, input_ids: torch.Tensor, media: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The keyword arguments a vision-language ``model``'s forward takes for ``media`` with
    ``input_ids``: the pixel inputs (the grid where its forward names it), and where the model asks
    for it (Qwen2-VL's M-RoPE) ``mm_token_type_ids`` (1 on image placeholder tokens,
    ``config.image_token_id``). ``model`` may be wrapped by an engine
    (:func:`core_rl.roles.wrapped.inner_model`)."""
    import inspect

    from core_rl.roles.wrapped import inner_model

    if not media:
        return {}
    model = inner_model(model)  # an engine's wrapper (DeepSpeed, peft) passes the keywords on
    config = getattr(model, "config", None)
    token = getattr(config, "image_token_id", None)
    forward = getattr(type(model), "forward", None)
    named = set(inspect.signature(forward).parameters) if forward is not None else set(media)
    # the grid only where the forward takes it (a whole-image family's (1, 1, 1) grids are core-rl's)
    kwargs: dict[str, Any] = {k: v for k, v in media.items() if k == "pixel_values" or k in named}
    if token is not None and "mm_token_type_ids" in named:
        kwargs["mm_token_type_ids"] = (input_ids == token).long()
    return kwargs
