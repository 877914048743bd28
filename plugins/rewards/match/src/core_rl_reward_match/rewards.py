"""Rewards comparing a response with the reference answer in its data row.

Both rewards normalise the same way (:meth:`MatchReward.normalise_response`,
:meth:`MatchReward.normalise_answer`) and differ only in how two normalised strings ``r``
(response) and ``a`` (answer) are scored:

- ``exact_match``: ``1.0 if r == a else 0.0``.
- ``char_match``: ``sum_i [r[i] == a[i]] / max(len(a), len(r))`` over ``i < min(len(a), len(r))``;
  ``1.0`` when both are empty. It is 1.0 exactly when ``r == a``.

With ``require_stop`` a response whose ``finish_reason`` is not ``"stop"`` (it hit the length
limit) scores 0.0 whatever its text.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from core_rl.config.validators import FieldValueError
from core_rl.errors import row_column
from core_rl.interfaces import Reward, RewardScores
from core_rl.protocol import RewardInput


def _non_empty(_inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value:
        raise FieldValueError(attribute.name, value, "must not be empty")


def _no_empty_strings(_inst: Any, attribute: attrs.Attribute[Any], value: list[str]) -> None:
    if any(s == "" for s in value):
        raise FieldValueError(attribute.name, value, "must not contain an empty string")


@attrs.define
class MatchConfig:
    """The ``reward`` section of ``exact_match`` and ``char_match`` (see the package README)."""

    answer_key: str = attrs.field(default="answer", validator=_non_empty)
    strip: bool = True
    case_sensitive: bool = True
    stop_at: list[str] = attrs.field(factory=list, validator=_no_empty_strings)
    require_stop: bool = False

    def required_columns(self) -> list[str]:
        """Every data row must hold the reference answer (checked before the run starts)."""
        return [self.answer_key]


def cut_at(text: str, markers: Sequence[str]) -> str:
    """``text`` up to (excluding) the earliest occurrence of any of ``markers``; all of it if none occurs."""
    ends = [i for i in (text.find(m) for m in markers) if i >= 0]
    return text[: min(ends)] if ends else text


def char_match_score(response: str, answer: str) -> float:
    """``sum_i [response[i] == answer[i]] / max(len(answer), len(response))``; 1.0 for two empty strings."""
    width = max(len(answer), len(response))
    if width == 0:
        return 1.0
    return sum(r == a for r, a in zip(response, answer)) / width


class MatchReward(Reward):
    """Normalises responses and answers per :class:`MatchConfig` and scores them with :meth:`compare`."""

    name = "match"

    def __init__(self, config: MatchConfig | None = None) -> None:
        self.config = config if config is not None else MatchConfig()

    def normalise_response(self, text: str) -> str:
        """Cut at ``stop_at``, then strip, then casefold (as configured)."""
        return self._common(cut_at(text, self.config.stop_at))

    def normalise_answer(self, value: Any) -> str:
        """``str(value)``, then strip, then casefold (as configured); ``stop_at`` is not applied."""
        return self._common(value if isinstance(value, str) else str(value))

    def _common(self, text: str) -> str:
        if self.config.strip:
            text = text.strip()
        if not self.config.case_sensitive:
            text = text.casefold()
        return text

    def answer_of(self, row: Mapping[str, Any]) -> Any:
        """The row's reference answer; :class:`DataError` if the column is missing or null."""
        return row_column(
            row,
            self.config.answer_key,
            reader=f"reward {self.name!r}",
            key_path="reward.answer_key",
            holds="the reference answer",
        )

    @abstractmethod
    def compare(self, response: str, answer: str) -> float:
        """Score two normalised strings."""

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        """The scores, and as ``answers`` each normalised response (``None`` for one that
        ``require_stop`` scores 0): the whole response is the answer, for majority voting."""
        scores: list[float] = []
        answers: list[str | None] = []
        for item in items:
            answer = self.normalise_answer(self.answer_of(item.row))
            if self.config.require_stop and item.finish_reason != "stop":
                scores.append(0.0)
                answers.append(None)
            else:
                response = self.normalise_response(item.response_text)
                scores.append(float(self.compare(response, answer)))
                answers.append(response)
        return RewardScores(scores=scores, answers=answers)

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores


class ExactMatchReward(MatchReward):
    """1.0 if the normalised response equals the normalised answer, else 0.0."""

    name = "exact_match"

    def compare(self, response: str, answer: str) -> float:
        return 1.0 if response == answer else 0.0


class CharMatchReward(MatchReward):
    """Position-wise character agreement, see :func:`char_match_score`."""

    name = "char_match"

    def compare(self, response: str, answer: str) -> float:
        return char_match_score(response, answer)
