"""``rotary_embedding`` in plain torch, with the signature SGLang's rotary layer calls on CPU.

``cos_sin_cache`` is ``[max_position, rotary_dim]``: cosines in the first half of the last
dimension, sines in the second. For each token at position ``p`` and each head, the first
``rotary_dim`` features ``x`` are rotated in place:

- neox style: ``x = [x1, x2]`` (halves) -> ``[x1*cos - x2*sin, x2*cos + x1*sin]``;
- GPT-J style: ``x1, x2`` are the even and odd features, rotated the same way and interleaved back.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Apply rotary position embeddings to ``query`` and ``key`` ([tokens, heads * head_size]) in place."""
    flat = positions.flatten()
    cos, sin = cos_sin_cache.index_select(0, flat).float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotary_dim = 2 * cos.shape[-1]
    for tensor in (query, key):
        if tensor is None:
            continue
        view = tensor.view(flat.shape[0], -1, head_size)
        view[..., :rotary_dim] = _rotate(view[..., :rotary_dim].float(), cos, sin, is_neox).to(view.dtype)
