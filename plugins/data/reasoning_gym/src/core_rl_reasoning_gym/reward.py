"""The ``reasoning_gym`` reward: a response's answer scored by the scorer of the reasoning-gym task
its row came from.

The answer is the text inside the response's last ``<answer>...</answer>`` (``answer_tag``; empty:
the whole response), stripped; a response without one scores 0. The task is the row's
``metadata["source_dataset"]`` (every reasoning-gym row names it), and the score is that task's
``score_answer(answer, entry)`` with ``entry = {"question": ..., "answer": row["answer"],
"metadata": row["metadata"]}``: reasoning-gym's own judgement, between 0 and 1 (some tasks give
partial credit). The metadata must be the dict reasoning-gym made: rows of the ``reasoning_gym``
data source keep it as it is, whereas a JSON file of them turns its tuples into lists, which some
scorers (``arc_agi``, ``rearc``) then score below 1 even for the gold answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from core_rl.errors import DataError, row_column
from core_rl.interfaces import Reward, RewardScores
from core_rl.protocol import RewardInput

from core_rl_reasoning_gym.source import reasoning_gym


@attrs.define
class ReasoningGymRewardConfig:
    """The ``reward`` section of ``reasoning_gym``: ``answer_tag`` (``""``: the whole response is
    the answer), and the columns holding the gold answer and the metadata."""

    answer_tag: str = "answer"
    answer_key: str = "answer"
    metadata_key: str = "metadata"

    def required_columns(self) -> list[str]:
        """Every row needs the metadata (naming its task); the gold answer may be null for some tasks."""
        return [self.metadata_key]


class ReasoningGymReward(Reward):
    """See the module docstring. Thread-safe: the scorers are made once per task, under a lock."""

    name = "reasoning_gym"

    def __init__(self, config: ReasoningGymRewardConfig | None = None) -> None:
        self.config = config if config is not None else ReasoningGymRewardConfig()
        self._scorers: dict[str, Callable[..., float]] = {}
        self._lock = threading.Lock()

    def scorer(self, task: str) -> Callable[..., float]:
        """``task``'s ``score_answer`` (made once)."""
        with self._lock:
            if task not in self._scorers:
                try:
                    self._scorers[task] = reasoning_gym().get_score_answer_fn(task)
                except ValueError:
                    raise DataError(
                        f"reward 'reasoning_gym': the row's metadata names task {task!r}, which reasoning-gym does "
                        "not register; the rows must come from reasoning-gym (the reasoning_gym data source)"
                    ) from None
            return self._scorers[task]

    def extract(self, response: str) -> str | None:
        """The answer in ``response`` (see the module docstring), ``None`` where there is none."""
        if not self.config.answer_tag:
            return response.strip()
        return reasoning_gym().utils.extract_answer(response, tag_name=self.config.answer_tag)

    def _task(self, row: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
        metadata = row.get(self.config.metadata_key)
        if not isinstance(metadata, Mapping) or not isinstance(metadata.get("source_dataset"), str):
            raise DataError(
                f"reward 'reasoning_gym': the row's {self.config.metadata_key!r} is not reasoning-gym metadata "
                "(a dict naming source_dataset); set reward.metadata_key, or train on the reasoning_gym data source"
            )
        return metadata["source_dataset"], metadata

    def score_with_parts(self, items: Sequence[RewardInput]) -> RewardScores:
        """The scores, and as ``answers`` each extracted answer (``None``: none), for majority voting."""
        scores: list[float] = []
        answers: list[str | None] = []
        for item in items:
            task, metadata = self._task(item.row)
            gold = row_column(
                item.row,
                self.config.answer_key,
                reader="reward 'reasoning_gym'",
                key_path="reward.answer_key",
                holds="the gold answer (null where the task scores from the metadata alone)",
                nullable=True,
            )
            answer = self.extract(item.response_text)
            answers.append(answer)
            if answer is None:
                scores.append(0.0)
                continue
            entry = {
                "question": item.row.get("prompt", ""),
                "answer": gold,
                "metadata": metadata,
            }
            scores.append(float(self.scorer(task)(answer=answer, entry=entry)))
        return RewardScores(scores=scores, answers=answers)

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return self.score_with_parts(items).scores
