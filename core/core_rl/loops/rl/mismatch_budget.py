"""``algorithm.mismatch_budget`` at run time (:class:`core_rl.config.schema.MismatchBudgetConfig`).

Every rank sees the same ``mismatch/*`` metrics (gathered or reduced over ranks by the update,
:mod:`core_rl.loops.rl.update`), so every rank counts the same streak and takes the same action.
A step over budget is one whose watched metric exceeds ``threshold``; after ``patience`` such
steps in a row the action happens and the streak starts over (so ``warn`` repeats every
``patience`` steps over budget, and ``correct`` happens once). The count and whether the
correction is on are kept in checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from core_rl.config.schema import MismatchBudgetConfig
from core_rl.errors import warn
from core_rl.loops.errors import RunFailed
from core_rl.loops.streaks import StreakCounter


class MismatchBudgetExceeded(RunFailed):
    """``algorithm.mismatch_budget.action: stop`` ends the run (exit status 1)."""


class MismatchBudget(StreakCounter):
    """See the module docstring. ``correct``: turns the correction on (``action: correct``), on
    every rank; ``is_main``: whether this rank prints. :attr:`stopping` holds the message of a
    ``stop`` action, raised by :meth:`stop_if_exceeded` once the step is logged."""

    def __init__(self, config: MismatchBudgetConfig, *, is_main: bool, correct: Callable[[], None] | None) -> None:
        super().__init__()
        self.config = config
        self.is_main = is_main
        self._correct = correct
        self.corrected = False
        self.stopping: str | None = None

    @property
    def metric_key(self) -> str:
        return f"mismatch/{self.config.metric}"

    def check(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Account for step ``step`` given the update's ``metrics`` and act when the budget says so;
        ``mismatch/over_budget`` (0/1), ``mismatch/over_budget_total`` and ``mismatch/correction_on``
        (whether the correction applied to this step's update).
        A step without the metric (no loss token) counts as within budget."""
        cfg = self.config
        value = metrics.get(self.metric_key)
        if cfg.threshold is None:
            return {}
        over = value is not None and value > cfg.threshold
        corrected = self.corrected  # during this step's update
        self.count(over)
        if over and self.streak >= cfg.patience:
            assert value is not None
            self._act(step, value)
        return {
            "mismatch/over_budget": float(over),
            "mismatch/over_budget_total": float(self.total),
            "mismatch/correction_on": float(corrected),
        }

    def _act(self, step: int, value: float) -> None:
        cfg = self.config
        streak = f" for {self.streak} steps in a row" if self.streak > 1 else ""
        what = (
            f"{self.metric_key} = {value:.4g} > algorithm.mismatch_budget.threshold {cfg.threshold:g} "
            f"at step {step}{streak}"
        )
        self.streak = 0
        if cfg.action == "stop":
            self.stopping = f"train/rollout mismatch over budget: {what}; algorithm.mismatch_budget.action: stop"
            return
        if cfg.action == "correct" and not self.corrected:
            assert self._correct is not None
            self._correct()
            self.corrected = True
            self._say(
                f"{what}; turning on the importance-sampling correction {cfg.correction.name!r} "
                f"(algorithm.mismatch_budget.correction) from step {step + 1} on"
            )
            return
        if cfg.action == "warn":
            self._say(what)

    def _say(self, line: str) -> None:
        if self.is_main:
            warn(f"train/rollout mismatch over budget: {line}")

    def stop_if_exceeded(self) -> None:
        """Raise :class:`MismatchBudgetExceeded` when a ``stop`` action is pending."""
        if self.stopping is not None:
            raise MismatchBudgetExceeded(self.stopping)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "corrected": self.corrected}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the count, and turn the correction back on when it was on."""
        super().load_state_dict(state)
        if state.get("corrected") and not self.corrected and self._correct is not None:
            self._correct()
            self.corrected = True
