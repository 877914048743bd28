"""Balanced assignment of a global batch's rows to data-parallel ranks (every rank computes the same
split from the same batch, without communicating)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from core_rl.protocol import TensorBatch


def row_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real length of each row of a right-padded ``[B, T]`` mask: 1 + the index of its last
    non-zero entry (0 for an all-padding row)."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be [B, T], got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[0] == 0:
        return []
    positions = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return (positions * (attention_mask != 0)).amax(dim=1).tolist()


RANK_ASSIGNMENTS = ("balanced", "strided")


def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:
    """Partition indices ``0..len(weights)-1`` into ``k`` parts of nearly equal weight sums by the
    largest differencing method (Karmarkar & Karp, generalised to ``k`` parts).

    Each item starts as a ``k``-tuple of parts (itself in one, the others empty). Repeatedly the two
    tuples with the largest spread (max part sum - min part sum) are merged: the heaviest part of
    one joins the lightest of the other, and so on, which cancels their imbalances; the last tuple
    left is the partition. Parts are returned with indices in increasing order, heaviest first
    (ties: by first index); with fewer items than ``k`` some parts are empty.
    """
    if k <= 0:
        raise ValueError(f"k must be > 0, got {k}")
    if not weights:
        return [[] for _ in range(k)]
    # heap entries: (-spread, tie-breaker, parts as [(sum, indices)] sorted by sum descending)
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, w in enumerate(weights):
        parts = [(int(w), [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-int(w), i, parts))
    counter = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are sorted heaviest first: pair a's heaviest with b's lightest
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    parts = [sorted(indices) for _, indices in heap[0][2]]
    return sorted(parts, key=lambda p: (-sum(weights[i] for i in p), p[0] if p else len(weights)))


def assign_rows_to_ranks(lengths: Sequence[int], world_size: int, method: str = "balanced") -> list[list[int]]:
    """Which rows of a global batch each data-parallel rank trains on: ``result[r]`` lists rank
    ``r``'s row indices in increasing order; every row goes to exactly one rank.

    - ``balanced``: Karmarkar-Karp over the rows' token counts (``max(length, 1)``), so every rank
      gets nearly the same number of tokens to process; ranks may get different numbers of rows
      (engines pad the micro-batch count). The heaviest part goes to rank 0.
    - ``strided``: row ``i`` to rank ``i % world_size`` (the same number of rows, whatever their lengths).

    Deterministic in ``lengths``: every rank computes the same assignment from the same batch.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be > 0, got {world_size}")
    if method == "strided":
        return [list(range(r, len(lengths), world_size)) for r in range(world_size)]
    if method != "balanced":
        raise ValueError(f"unknown rank assignment {method!r}; expected one of {', '.join(RANK_ASSIGNMENTS)}")
    return karmarkar_karp([max(x, 1) for x in lengths], world_size)


def rank_rows(batch: TensorBatch, rank: int, world_size: int, method: str = "balanced") -> list[int]:
    """The rows of the global ``batch`` that data-parallel rank ``rank`` trains on
    (:func:`assign_rows_to_ranks` over the rows' lengths from ``batch["attention_mask"]``); every
    rank holding the same batch computes the same split without communicating."""
    return assign_rows_to_ranks(row_lengths(batch["attention_mask"]), world_size, method)[rank]
