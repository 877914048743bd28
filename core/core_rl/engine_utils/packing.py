"""Balanced grouping of rows by token load: into micro-batches (first-fit-decreasing or
Karmarkar-Karp) and across data-parallel ranks. Pure functions of the rows' lengths, so every rank
computes the same answer without communicating.

Two cost models, one per micro-batch layout (:mod:`core_rl.engine_utils.packed`):

- ``padded``: the micro-batch is a ``[rows, width]`` tensor, its cost ``rows * width``
  (:func:`core_rl.engine_utils.microbatch.micro_batch_cost`);
- ``packed``: the rows are concatenated into one ``[1, sum(lengths)]`` row (padding-free), its cost
  the sum of the lengths (:func:`packed_cost`).

Algorithms (the ``actor.micro_batch.packing_algorithm`` names):

- ``greedy``: consecutive rows in their order (:func:`core_rl.engine_utils.microbatch.pack_micro_batches`);
- ``ffd``: first-fit-decreasing bin packing: rows by decreasing length, each into the first
  micro-batch it fits in; few micro-batches, little padding (rows of similar length end up together),
  then evened out (:func:`evened_first_fit_decreasing`: the same number, the costliest lighter);
- ``kk``: Karmarkar-Karp (largest differencing) ``k``-way partition with the smallest ``k`` whose
  parts all fit: micro-batches of nearly equal token load.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from core_rl.engine_utils.microbatch import micro_batch_cost, pack_micro_batches, row_lengths
from core_rl.protocol import TensorBatch

ALGORITHMS = ("greedy", "ffd", "kk")
RANK_ASSIGNMENTS = ("balanced", "strided")

Cost = Callable[[Sequence[int], Sequence[int]], int]


def packed_cost(lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Tokens of the packed micro-batch made of ``rows``: ``sum(max(length, 1))`` (an all-padding
    row still takes one position)."""
    return sum(max(lengths[i], 1) for i in rows)


def cost_function(packed: bool) -> Cost:
    """:func:`packed_cost` for the packed layout, else the padded ``rows * width``."""
    return packed_cost if packed else micro_batch_cost


def first_fit_decreasing(lengths: Sequence[int], capacity: int, cost: Cost = micro_batch_cost) -> list[list[int]]:
    """Bins of row indices, each of ``cost <= capacity`` unless it holds a single row longer than
    ``capacity`` (rows are never cut). Rows are taken by decreasing length (ties: lower index
    first) and each goes into the first bin, in creation order, where it still fits; otherwise it
    opens a new bin. Rows within a bin are in increasing index order. The two layouts' costs are
    kept per bin as rows go in (a bin's first row is its widest); any other is recomputed."""
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    costs: list[int] = []  # each bin's cost so far

    def added(b: int, i: int) -> int:
        """Bin ``b``'s cost with row ``i`` in it."""
        if cost is packed_cost:
            return costs[b] + max(lengths[i], 1)
        if cost is micro_batch_cost:  # the width is the bin's first (longest) row's
            return costs[b] + max(lengths[bins[b][0]], 1)
        return cost(lengths, [*bins[b], i])

    for i in order:
        for b in range(len(bins)):
            with_row = added(b, i)
            if with_row <= capacity:
                bins[b].append(i)
                costs[b] = with_row
                break
        else:
            bins.append([i])
            costs.append(cost(lengths, [i]))
    return [sorted(rows) for rows in bins]


def evened_first_fit_decreasing(
    lengths: Sequence[int], capacity: int, cost: Cost = micro_batch_cost
) -> list[list[int]]:
    """:func:`first_fit_decreasing` with the capacity lowered as far as it still needs no more bins
    than at ``capacity``: never more micro-batches nor a costlier one, the costliest as light as
    the search finds (within 1/64 of ``capacity``), rows of similar length still together. Rows
    worth 1.08 budgets then make two halves, not a full micro-batch and a small one: the peak of
    the activations kept for backward follows the costliest micro-batch, the time hardly the split."""
    groups = first_fit_decreasing(lengths, capacity, cost)
    if len(groups) <= 1:
        return groups
    # no capacity below the costliest row or an even share of the tokens can do with fewer bins
    total = packed_cost(lengths, range(len(lengths)))
    low = max(max(cost(lengths, [i]) for i in range(len(lengths))), -(-total // len(groups)))
    count, peak = len(groups), max(cost(lengths, g) for g in groups)
    high, step = capacity, max(1, capacity // 64)
    while high - low > step:
        middle = (low + high) // 2
        trial = first_fit_decreasing(lengths, middle, cost)
        if len(trial) > count:
            low = middle + 1
            continue
        high = middle
        trial_peak = max(cost(lengths, g) for g in trial)
        if trial_peak < peak:
            groups, peak = trial, trial_peak
    return groups


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


def _split_in_two(lengths: Sequence[int], rows: list[int]) -> list[list[int]]:
    halves = karmarkar_karp([max(lengths[i], 1) for i in rows], 2)
    return [[rows[j] for j in half] for half in halves]


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, min_num: int = 1, *, algorithm: str = "ffd", packed: bool = False
) -> list[list[int]]:
    """Partition rows ``0..len(lengths)-1`` into micro-batches of cost ``<= max_tokens`` (a single
    overlong row excepted) and at least ``min(min_num, len(lengths))`` of them, by ``algorithm``
    (see the module docstring) under the cost model of the layout (``packed`` or padded).

    ``ffd`` reaching fewer than ``min_num`` bins splits the costliest bin with more than one row in
    two balanced halves until it has enough; ``kk`` uses ``k = max(min_num, bins of ffd)`` and
    raises ``k`` until every part fits. Every row appears exactly once; micro-batches are ordered
    by their first row.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    n = len(lengths)
    if n == 0:
        return []
    if algorithm == "greedy":
        return pack_micro_batches(lengths, max_tokens, min_num)
    cost = cost_function(packed)
    target = min(min_num, n)
    if algorithm == "ffd":
        groups = evened_first_fit_decreasing(lengths, max_tokens, cost)
        while len(groups) < target:
            worst = max((g for g in groups if len(g) > 1), key=lambda g: cost(lengths, g))
            groups.remove(worst)
            groups.extend(_split_in_two(lengths, worst))
    else:
        k = max(target, len(first_fit_decreasing(lengths, max_tokens, cost)))
        while True:
            parts = [p for p in karmarkar_karp([max(x, 1) for x in lengths], k) if p]
            if all(len(p) == 1 or cost(lengths, p) <= max_tokens for p in parts) or k >= n:
                groups = parts
                break
            k += 1
    return sorted(groups, key=lambda g: g[0])


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
