"""Splitting a rank's rows into micro-batches (pure functions, no process group).

A micro-batch is a list of row indices; its *width* is the longest real length among its rows (the
trailing columns that are padding in every one of its rows are trimmed), and its *cost* is
``rows x width`` tokens, the size of the padded tensor the model sees.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from core_rl.protocol import TensorBatch
from core_rl.vision.media import MEDIA_KEYS


def micro_batch_width(lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Padded width of the micro-batch made of ``rows``: their longest length, at least 1."""
    return max([1, *(lengths[i] for i in rows)])


def micro_batch_cost(lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Tokens of the padded micro-batch: ``len(rows) * width`` (0 for no rows)."""
    return len(rows) * micro_batch_width(lengths, rows) if rows else 0


def pack_micro_batches(lengths: Sequence[int], max_tokens: int, min_num: int = 1) -> list[list[int]]:
    """Partition rows ``0..len(lengths)-1`` into consecutive micro-batches, order preserved.

    1. Greedy: rows are appended to the current micro-batch while its cost stays
       ``<= max_tokens``; otherwise a new one starts. Because a micro-batch's cost never falls when
       a row is added, this gives the fewest consecutive micro-batches within the limit. A single
       row longer than ``max_tokens`` forms a micro-batch of its own (rows are never cut).
    2. While there are fewer than ``min(min_num, len(lengths))`` micro-batches, the costliest one
       with at least two rows is split in two at the point that minimises the larger half's cost.
       Splitting never raises a cost, so the limit of step 1 still holds.

    Every row appears exactly once. No rows give no micro-batches.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    groups: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i, length in enumerate(lengths):
        new_width = max(width, length, 1)
        if current and (len(current) + 1) * new_width > max_tokens:
            groups.append(current)
            current, new_width = [], max(length, 1)
        current.append(i)
        width = new_width
    if current:
        groups.append(current)
    target = min(min_num, len(lengths))
    while len(groups) < target:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        worst = max(splittable, key=lambda g: micro_batch_cost(lengths, groups[g]))
        rows = groups[worst]
        cut = _best_cut(rows, lengths)
        groups[worst : worst + 1] = [rows[:cut], rows[cut:]]
    return groups


def _best_cut(rows: Sequence[int], lengths: Sequence[int]) -> int:
    """The ``k`` in ``1..len(rows)-1`` minimising ``max(cost(rows[:k]), cost(rows[k:]))`` (the first
    such ``k``), from prefix and suffix maxima of the lengths."""
    n = len(rows)
    prefix = [0] * (n + 1)  # prefix[k]: width of rows[:k]
    suffix = [0] * (n + 1)  # suffix[k]: width of rows[k:]
    for k in range(n):
        prefix[k + 1] = max(prefix[k], lengths[rows[k]], 1)
        suffix[n - 1 - k] = max(suffix[n - k], lengths[rows[n - 1 - k]], 1)
    return min(range(1, n), key=lambda k: max(k * prefix[k], (n - k) * suffix[k]))


def take_micro_batch(batch: TensorBatch, rows: Sequence[int], width: int) -> TensorBatch:
    """The rows ``rows`` of ``batch`` with every ``[B, T]`` tensor (2-D or more, second dimension
    equal to the batch's ``input_ids`` width) cut to its first ``width`` columns; other tensors
    (``[B]`` ones such as ``rewards``, and the pixel inputs :data:`~core_rl.vision.media.MEDIA_KEYS`)
    are only row-indexed. Each tensor is a new contiguous one,
    never a view: a compiled model guards on its inputs' strides and on whether they are views, so
    a cut view beside an uncut tensor would compile a second graph."""
    full_width = batch["input_ids"].shape[1]
    index = torch.as_tensor(list(rows), dtype=torch.long)
    out = {}
    for key in batch.keys():
        value = batch[key]
        if value.ndim >= 2 and value.shape[1] == full_width and key not in MEDIA_KEYS:
            value = value[:, :width]
        out[key] = value[index]
    return TensorBatch(out)


def placeholder_micro_batch(pad_token_id: int) -> dict[str, torch.Tensor]:
    """Model inputs of a one-token micro-batch used by a rank that has run out of rows, so every
    rank runs the same number of forward/backward passes (sharded engines' collectives must line up)."""
    return {
        "input_ids": torch.full((1, 1), pad_token_id, dtype=torch.long),
        "attention_mask": torch.ones((1, 1), dtype=torch.long),
    }
