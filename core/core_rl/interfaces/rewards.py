"""The contract of a reward (:class:`Reward`) and what it returns with its parts
(:class:`RewardScores`); re-exported by :mod:`core_rl.interfaces` beside the other components'."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from core_rl.protocol import RewardInput


@attrs.define
class RewardScores:
    """What :meth:`Reward.score_with_parts` returns: ``scores`` (one per item, in order) and
    ``parts``: name -> one value per item (for example each part of a combined reward, or a 0/1
    flag such as "an answer was found"). ``None`` marks an item a part does not apply to (a routed
    reward's part for another route's samples): it is left out of the part's statistics, while a
    NaN counts as ``reward/<name>/nonfinite``. The trainer reports each part as ``reward/<name>/mean``
    (and ``std``, ``min``, ``max``) over the items it applies to. ``answers`` (optional): the final
    answer each response gives as the reward read it (``None``: none found), for majority voting
    in evaluation (``eval/maj@n``)."""

    scores: list[float]
    parts: dict[str, list[float | None]] = attrs.field(factory=dict)
    answers: list[str | None] | None = None


class Reward(ABC):
    """Scores responses. Scores are floats; by convention in [0, 1] for verifiable tasks."""

    @abstractmethod
    def score(self, items: Sequence[RewardInput]) -> list[float]:
        """One score per item, in order. The trainer may call it from several threads at once
        (``reward_runner.num_workers``) and stops waiting for a call after ``reward_runner.timeout_s``."""

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        """The scores plus named per-item values worth reporting (see :class:`RewardScores`).
        Default: :meth:`score` and no parts. A reward overriding it must keep ``scores`` equal to
        what :meth:`score` returns."""
        return RewardScores(scores=list(self.score(items)))

    def close(self) -> None:
        """Release resources (worker processes, HTTP clients, models). Default: nothing."""
