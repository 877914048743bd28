"""Pooling the rows of the ranks that run one model replica together.

Ranks that compute one micro-batch together (a tensor-, pipeline- or context-parallel replica; a
sequence-parallel group, :mod:`core_rl_train_kit.ulysses`) each receive their own rows of the
global batch from the trainer. They first pool them: every rank of the group gets all of the
group's rows, in rank order, and the slice of them that is its own, so it can hand back its own
rows' results.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from core_rl.protocol import TensorBatch


def pool_rows(batch: TensorBatch, group: Any, size: int, index: int, pad_token_id: int) -> tuple[TensorBatch, slice]:
    """The rows of the ``size`` ranks of ``group`` (their batches in rank order, right-padded to the
    widest) and the slice of them that is this rank's (``index`` in the group). A group of one (or
    ``group=None``) returns ``batch`` itself. Collective over ``group`` (an object all-gather of the
    CPU tensors)."""
    if group is None or size == 1:
        return batch, slice(0, batch.batch_size)
    parts: list[object] = [None] * size
    dist.all_gather_object(parts, {k: batch[k].cpu() for k in batch.keys()}, group=group)
    batches = [TensorBatch(p) for p in parts]  # type: ignore[arg-type]
    widest = max(b["input_ids"].shape[1] for b in batches)
    merged = TensorBatch.concat([pad_width(b, widest, pad_token_id) for b in batches])
    start = sum(b.batch_size for b in batches[:index])
    return merged, slice(start, start + batch.batch_size)


def pad_width(batch: TensorBatch, width: int, pad_token_id: int) -> TensorBatch:
    """``batch`` with every ``[B, T, ...]`` tensor right-padded to ``width`` columns (``pad_token_id``
    for ``input_ids``, zeros elsewhere, so padding stays masked out)."""
    current = batch["input_ids"].shape[1]
    if current == width:
        return batch
    out = {}
    for key in batch.keys():
        value = batch[key]
        if value.ndim >= 2 and value.shape[1] == current:
            fill = pad_token_id if key == "input_ids" else 0
            pad = value.new_full((value.shape[0], width - current, *value.shape[2:]), fill)
            value = torch.cat([value, pad], dim=1)
        out[key] = value
    return TensorBatch(out)
