"""What loggers receive besides metrics: the run they log (:class:`RunInfo`) and its sample records
(:class:`SampleRecord`, :func:`sample_table`). Importable from :mod:`core_rl.interfaces` too, beside
:class:`~core_rl.interfaces.Logger`."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs


@attrs.define
class RunInfo:
    """What a logger learns about the run when it starts. ``resume_step``: set when the run
    continues an earlier one from the checkpoint of that step (0: from the start); a logger that
    keeps its own records should drop those of later steps, which the run will log again."""

    name: str
    output_dir: Path
    config: Mapping[str, Any]
    resume_step: int | None = None


@attrs.define
class SampleRecord:
    """One generated sample as loggers show it: texts, its reward (and the reward's parts, see
    :class:`~core_rl.interfaces.RewardScores`), why generation stopped (``stop`` or ``length``) and what the rollout
    workflow recorded about it (:attr:`core_rl.protocol.Sample.info`). ``prompt`` is the prompt as
    the data holds it (what rewards read); ``rendered_prompt``, where given, the prompt as the model
    was given it: its tokens decoded with the special ones, so the chat template's rendering under
    ``data.apply_chat_template`` (system prompt, turn markers, generation prompt)."""

    prompt: str
    response: str
    reward: float
    finish_reason: str
    parts: dict[str, float] = attrs.field(factory=dict)
    info: dict[str, Any] = attrs.field(factory=dict)
    rendered_prompt: str | None = None

    def as_row(self) -> dict[str, Any]:
        """A flat row: ``prompt``, ``rendered_prompt`` (where given), ``response``, ``reward``,
        ``finish_reason``, ``reward/<part>``..., ``info/<key>``..."""
        row: dict[str, Any] = {"prompt": self.prompt}
        if self.rendered_prompt is not None:
            row["rendered_prompt"] = self.rendered_prompt
        row |= {
            "response": self.response,
            "reward": self.reward,
            "finish_reason": self.finish_reason,
        }
        row.update({f"reward/{k}": v for k, v in self.parts.items()})
        row.update({f"info/{k}": v for k, v in self.info.items()})
        return row


def sample_table(samples: Sequence[SampleRecord]) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` of ``samples`` for loggers with tables: the columns of
    :meth:`SampleRecord.as_row`, in order of first appearance; a missing part is ``None``; a cell
    that is not a number, string or ``None`` (a workflow's ``info`` list or mapping) is its JSON text."""
    rows = [s.as_row() for s in samples]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return columns, [[_table_cell(row.get(c)) for c in columns] for row in rows]


def _table_cell(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float)):
        return value
    return json.dumps(value, default=str)


class Logger(ABC):
    """Receives metrics once per step."""

    def start(self, run: RunInfo) -> None:
        """Called once before the first step."""

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (flat names like ``reward/mean``) for ``step``: 1 and up, in order, and
        step 0 before them when ``eval.before_train`` evaluated the starting policy (``eval/*`` alone)."""

    def log_samples(self, samples: Sequence[SampleRecord], step: int) -> None:
        """Record a few of ``step``'s samples (every ``sample_log.every_n_steps`` steps), e.g. as a
        table. Default: ignore them."""

    def close(self) -> None:
        """Called once after the last step (also on failure); flush and release."""
