"""Balanced grouping of rows by token load: into micro-batches (first-fit-decreasing or
Karmarkar-Karp) and across data-parallel ranks. Pure functions of the rows' lengths, so every rank
computes the same answer without communicating.

Two cost models, one per micro-batch layout (:mod:`core_rl_train_kit.packed`):

- ``padded``: the micro-batch is a ``[rows, width]`` tensor, its cost ``rows * width``
  (:func:`core_rl_train_kit.microbatch.micro_batch_cost`);
- ``packed``: the rows are concatenated into one ``[1, sum(lengths)]`` row (padding-free), its cost
  the sum of the lengths (:func:`packed_cost`).

Algorithms (the ``actor.micro_batch.packing_algorithm`` names):

- ``greedy``: consecutive rows in their order (:func:`core_rl_train_kit.microbatch.pack_micro_batches`);
- ``ffd``: first-fit-decreasing bin packing: rows by decreasing length, each into the first
  micro-batch it fits in; few micro-batches, little padding (rows of similar length end up together),
  then evened out (:func:`evened_first_fit_decreasing`: the same number, the costliest lighter);
- ``kk``: Karmarkar-Karp (largest differencing) ``k``-way partition with the smallest ``k`` whose
  parts all fit: micro-batches of nearly equal token load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from core_rl.data import karmarkar_karp

from core_rl_train_kit.microbatch import micro_batch_cost, pack_micro_batches

ALGORITHMS = ("greedy", "ffd", "kk")

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
