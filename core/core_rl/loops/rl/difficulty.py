"""``data.difficulty_filter``: the records of how hard each training prompt was, and the decision
to skip a prompt when it is drawn again (:class:`~core_rl.config.data_config.DifficultyFilterConfig`).

*Records.* After each generation batch of the RL loop is scored, every prompt in it gets as its
record the mean of its group's rule rewards (the ``reward:`` function's scores, before
``algorithm.reward_shaping`` and advantage normalisation; samples the reward runner dropped and
non-finite scores left out; a group with none left keeps the record it had). A prompt is named by
its index in :attr:`core_rl.data.prompts.PromptSource.items` (:attr:`PromptItem.index`); a newer
group of the same prompt replaces its record.

*Skipping.* When :class:`~core_rl.data.prompts.PromptSource` draws the prompt at ``position`` of
epoch ``epoch``'s order and its record is ``>= easy_threshold`` (easy) or ``<= hard_threshold``
(hard), it is kept with probability ``keep_probability``: kept when
``random.Random(f"core-rl-difficulty:{seed}:{epoch}:{position}").random() < keep_probability``,
a pure function of the experiment seed and the draw's place, so no RNG state needs saving. A prompt
not kept is skipped and the next one of the order drawn in its place, so every batch keeps
``data.batch_size`` prompts; a skipped prompt counts as drawn in its epoch (the data position
moves past it). ``trainer.total_epochs`` still derives ``ceil(E x P / B)`` steps when the run
starts (:mod:`core_rl.config.epochs`; the schedules need the count then): each step trains ``B``
prompts whatever was skipped, so a run that skips reaches further into the epoch order, past ``E``
passes, as dynamic sampling does.

*Nothing left.* A draw that reaches the end of an epoch having skipped its every draw (every
prompt of a plain epoch; of a weighted mixture, every draw of that epoch) raises
:class:`DifficultyFilterError` rather than looking further: with ``keep_probability: 0`` no
prompt would ever be drawn again. (With ``keep_probability > 0`` a whole epoch of easy or hard
prompts is skipped by chance with probability ``(1 - keep_probability) ** P``.) So a draw never
looks through more than two epochs.

*Checkpoints.* The records are saved in the trainer's checkpoints (extra ``difficulty``),
apart from the data position (which the rollout controller sets to the first wave not trained
on), and restored on resume. In the synchronous loop (``max_head_offpolicyness: 0``) a wave is
drawn only after the previous one was scored, so a resumed run draws exactly the prompts the
uninterrupted run drew. With asynchronous rollouts a wave is drawn while earlier ones are still
generating: the records it sees depend on timing, and a resumed run, which draws the waves that
were in flight again under the records of its checkpoint, may skip differently.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from core_rl.config.data_config import DifficultyFilterConfig
from core_rl.errors import CoreRLError

EASY = "easy"
HARD = "hard"


class DifficultyFilterError(CoreRLError):
    """``data.difficulty_filter`` skipped every draw of an epoch: nothing left to draw."""


def keeps_anyway(seed: int, epoch: int, position: int, keep_probability: float) -> bool:
    """Whether the easy or hard prompt at ``position`` of epoch ``epoch``'s order is drawn all the
    same: ``random.Random(f"core-rl-difficulty:{seed}:{epoch}:{position}").random() < keep_probability``."""
    if keep_probability <= 0.0:
        return False
    return random.Random(f"core-rl-difficulty:{seed}:{epoch}:{position}").random() < keep_probability


def group_means(prompts: Sequence[int], groups: Sequence[int], rewards: Sequence[float | None]) -> dict[int, float]:
    """Prompt index -> the mean of its group's finite rewards, from one value per sample: the
    sample's prompt index, its group and its reward. A prompt with several groups takes the last
    group (the latest drawn); a group without a finite reward gives nothing."""
    sums: dict[int, tuple[int, float, int]] = {}  # group -> (prompt, sum, count)
    for prompt, group, reward in zip(prompts, groups, rewards, strict=True):
        if reward is None or not math.isfinite(reward):
            continue
        _, total, count = sums.get(group, (prompt, 0.0, 0))
        sums[group] = (prompt, total + float(reward), count + 1)
    return {prompt: total / count for _, (prompt, total, count) in sorted(sums.items())}


class DifficultyRecords:
    """The records of a run's training prompts and the skip decision (see the module docstring).
    ``prompts``: how many items the prompt source holds. Safe to use from the rollout controller's
    thread (drawing) and the trainer's (observing) at once."""

    def __init__(self, config: DifficultyFilterConfig, *, seed: int, prompts: int) -> None:
        self.config = config
        self.seed = seed
        self.prompts = prompts
        self._records: dict[int, float] = {}
        self._lock = threading.Lock()

    def kind(self, mean: float) -> str | None:
        """``"easy"`` (``mean >= easy_threshold``), ``"hard"`` (``mean <= hard_threshold``) or ``None``."""
        easy, hard = self.config.easy_threshold, self.config.hard_threshold
        if easy is not None and mean >= easy:
            return EASY
        if hard is not None and mean <= hard:
            return HARD
        return None

    def skip_reason(self, index: int, epoch: int, position: int) -> str | None:
        """Why the prompt ``index``, drawn at ``position`` of epoch ``epoch``, is skipped (``"easy"``
        or ``"hard"``), or ``None`` when it is drawn."""
        with self._lock:
            mean = self._records.get(index)
        why = self.kind(mean) if mean is not None else None
        if why is None or keeps_anyway(self.seed, epoch, position, self.config.keep_probability):
            return None
        return why

    def observe(self, means: Mapping[int, float]) -> None:
        """Set the records of the prompts in ``means`` (prompt index -> group-mean reward)."""
        with self._lock:
            self._records.update({int(k): float(v) for k, v in means.items()})

    def metrics(self) -> dict[str, float]:
        """``data/known_easy_fraction`` and ``data/known_hard_fraction``: the fractions of the prompts
        with a record that are easy and hard now; ``data/known_prompts``: how many have one."""
        with self._lock:
            means = list(self._records.values())
        kinds = [self.kind(m) for m in means]
        known = max(len(means), 1)
        return {
            "data/known_easy_fraction": kinds.count(EASY) / known,
            "data/known_hard_fraction": kinds.count(HARD) / known,
            "data/known_prompts": float(len(means)),
        }

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            indices = sorted(self._records)
            return {"prompts": self.prompts, "indices": indices, "means": [self._records[i] for i in indices]}

    def load_state_dict(self, state: Mapping[str, Any]) -> str | None:
        """Restore :meth:`state_dict`; returns a warning instead when the saved records are of a
        different number of prompts (the data changed: indices name other prompts, so none is kept)."""
        if not state:
            return None
        if int(state["prompts"]) != self.prompts:
            with self._lock:
                self._records = {}
            return (
                f"data.difficulty_filter: the checkpoint's records are of {state['prompts']} training prompts and the "
                f"data now holds {self.prompts}; the records are dropped and every prompt is measured again"
            )
        with self._lock:
            self._records = {int(i): float(m) for i, m in zip(state["indices"], state["means"], strict=True)}
        return None

    def nothing_left(self, skipped: int, epoch: int) -> DifficultyFilterError:
        """The error of a draw that skipped every draw of epoch ``epoch`` (``skipped`` in a row)."""
        cfg = self.config
        return DifficultyFilterError(
            f"data.difficulty_filter: skipped every prompt of epoch {epoch} ({skipped} in a row), nothing left to "
            f"draw: each one's last mean reward is easy (>= easy_threshold={cfg.easy_threshold}) or hard "
            f"(<= hard_threshold={cfg.hard_threshold}) and keep_probability={cfg.keep_probability} kept none. Set "
            "keep_probability > 0 (to draw some of them again), move the thresholds, or stop the run earlier "
            "(trainer.total_steps)"
        )
