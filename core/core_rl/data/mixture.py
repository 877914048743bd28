"""The order in which a weighted mixture of training sources is drawn (``data.train_files`` given as
``{path: ..., weight: ...}`` entries, :class:`core_rl.config.schema.TrainFile`).

With sources ``s`` of ``size_s`` prompts each (after filtering), ``P = sum size_s`` and weights
``w_s`` (``W = sum w_s``), an epoch is ``P`` draws, as without weights (so
``trainer.total_epochs`` counts the same steps, :mod:`core_rl.config.epochs`), of which source
``s`` gives ``n_s`` (:func:`apportion`: ``P x w_s / W`` rounded by largest remainder, so
``|n_s - P w_s / W| < 1`` and ``sum n_s = P``). A source draws from its own endless stream: its
prompts in a seeded shuffled order, reshuffled each time it runs out, so a source weighted above
its size's share is repeated and one below is subsampled, every prompt of a source drawn as
evenly as the draws allow (counts differ by at most one). Epoch ``e`` takes the draws
``[e n_s, (e + 1) n_s)`` of each stream, and the epoch's ``P`` draws are shuffled (seed
``seed + e``, as a plain epoch is).

Everything is a pure function of ``(seed, epoch)``: the data position of a checkpoint (epoch,
position) is all a resumed run needs to draw exactly the prompts the uninterrupted run would. With
``data.shuffle: false`` the streams keep file order and an epoch lists its sources' draws in the
order of ``data.train_files``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (each > 0): the floors of the exact shares,
    then one more to the largest remainders (ties: the earlier source) until they sum to ``total``."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _pass_order(seed: int, source: int, lap: int, size: int, shuffle: bool) -> list[int]:
    """The order of a source's ``lap``-th pass over its ``size`` prompts."""
    order = list(range(size))
    if shuffle:
        random.Random(f"core-rl-mixture:{seed}:{source}:{lap}").shuffle(order)
    return order


def mixture_order(
    sources: Sequence[Sequence[int]], weights: Sequence[float], *, seed: int, epoch: int, shuffle: bool
) -> list[int]:
    """The item indices epoch ``epoch`` draws, in order (see the module docstring); ``sources``:
    each source's item indices (none empty), ``weights`` its weight."""
    counts = apportion(sum(len(s) for s in sources), weights)
    order: list[int] = []
    for index, (members, n) in enumerate(zip(sources, counts)):
        size, laps = len(members), {}
        for draw in range(epoch * n, (epoch + 1) * n):
            lap, offset = divmod(draw, size)
            if lap not in laps:
                laps[lap] = _pass_order(seed, index, lap, size, shuffle)
            order.append(members[laps[lap][offset]])
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order
