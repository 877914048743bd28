"""Steps where every episode failed, and the limit on such steps in a row.

An episode (a trajectory) fails when its workflow marks it so (``Sample.info["failed"]``,
:data:`core_rl.rollout.workflows.FAILED`: an environment step or reset past
``rollout.workflow.tool_timeout_s``) or when the reward failed on it (a reward call that raised or
timed out, a score that is not a finite number: :mod:`core_rl.loops.rl.reward_runner`). Such episodes
still train (with reward 0, or ``reward_runner.error_value``), so a run whose every episode fails
would go on learning nothing and end with exit status 0.

A step with at least one episode, all failed, is a *failed step* (:class:`FailedSteps`): it prints
a warning naming what failed and counts in the metrics ``rollout/failed_step`` (1 on such a step,
else 0) and ``rollout/failed_steps_total``; ``rollout/failed_episodes`` counts the step's failed
episodes on every step. ``algorithm.max_consecutive_failed_steps`` failed steps in a row end the run
(:class:`FailedStepsError`, exit status 1; 0: no limit). The counts are kept in checkpoints.

Episodes ended by an agent's error (``Sample.info["error"]``, :data:`core_rl.rollout.workflows.ERROR`,
and those a workflow left out, :data:`~core_rl.rollout.workflows.DROPPED_ERRORS`) are counted by kind,
``agent/errors/<kind>`` (and ``agent/errors_total``); past the fraction of the step's episodes the
workflow allows (:data:`~core_rl.rollout.workflows.ERROR_LIMIT`) the run ends (:class:`AgentErrorsError`,
exit status 1) with one line naming the most common kind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from core_rl.errors import warn
from core_rl.loops.errors import RunFailed
from core_rl.loops.rl.reward_runner import ScoreResult
from core_rl.loops.streaks import StreakCounter
from core_rl.plugins.tally import Counts
from core_rl.protocol import Sample
from core_rl.rollout.workflows import DROPPED_ERRORS, ERROR, ERROR_LIMIT, FAILED


class FailedStepsError(RunFailed):
    """``algorithm.max_consecutive_failed_steps`` steps in a row had every episode fail."""


class AgentErrorsError(RunFailed):
    """More of a step's episodes ended in an agent error than its workflow allows."""


class FailedEpisodes:
    """The failed episodes of one step's generation batches (:meth:`add` each): ``failed`` of
    ``total``, and why, by reason; the agent errors by kind (``errors``), an example message of
    each (``examples``) and the lowest limit on them the samples carried (``error_limit``)."""

    def __init__(self) -> None:
        self.failed = 0
        self.total = 0
        self.reasons: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.error_limit: float | None = None

    def add(self, samples: Sequence[Sample], scored: ScoreResult) -> None:
        """Count ``samples`` (a generation batch) and which of them failed: marked by the workflow,
        or an item of ``scored`` (their rewards) that failed."""
        reward_failed = {f.index: f.kind for f in scored.failures}
        self.total += len(samples)
        for i, sample in enumerate(samples):
            reason = (sample.info or {}).get(FAILED) or (f"reward {reward_failed[i]}" if i in reward_failed else "")
            if reason:
                self.failed += 1
                self.reasons[str(reason)] += 1
            info = sample.info or {}
            if info.get(ERROR):
                self.errors[str(info[ERROR])] += 1
                self.examples.setdefault(str(info[ERROR]), str(reason))
            for kind, count in (info.get(DROPPED_ERRORS) or {}).items():
                self.errors[str(kind)] += int(count)
                self.total += int(count)
            limit = info.get(ERROR_LIMIT)
            if isinstance(limit, int | float) and (self.error_limit is None or limit < self.error_limit):
                self.error_limit = float(limit)

    def error_metrics(self, step: int) -> dict[str, float]:
        """``agent/errors/<kind>`` and ``agent/errors_total`` of the step; raises
        :class:`AgentErrorsError` when the errored fraction of its episodes passes the limit."""
        if not self.errors:
            return {}
        metrics = {f"agent/errors/{kind}": float(n) for kind, n in self.errors.items()}
        total = sum(self.errors.values())
        metrics["agent/errors_total"] = float(total)
        if self.error_limit is not None and self.total and total / self.total > self.error_limit:
            kind, n = self.errors.most_common(1)[0]
            example = self.examples.get(kind, "")
            raise AgentErrorsError(
                f"step {step}: {total} of {self.total} episodes ended in an agent error, past "
                f"rollout.workflow.max_error_fraction={self.error_limit:g}; most common: {kind} ({n})"
                + (f": {' '.join(example.split())[:300]}" if example else "")
                + "; fix the agent, or raise the fraction"
            )
        return metrics

    def why(self, taken: Mapping[str, Counts]) -> str:
        """What failed, for the step's message: each reason's count, then each plugin with calls
        that timed out or raised (``taken``: :meth:`core_rl.plugins.tally.PluginTally.take`)."""
        parts = [f"{reason}: {n}" for reason, n in self.reasons.most_common()]
        for c in taken.values():
            if c.failed:
                what = f" ({c.what})" if c.what else ""
                parts.append(f"{c.words}: {c.timeouts} calls timed out{what}, {c.errors} raised")
        return "; ".join(parts)


class FailedSteps(StreakCounter):
    """Counts the failed steps and ends the run at ``limit`` in a row (see the module docstring).
    ``total``/``streak``: such steps so far / in a row."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def check(self, step: int, failed: int, episodes: int, why: str) -> dict[str, float]:
        """Account for step ``step``: ``failed`` of its ``episodes`` failed, ``why`` (what failed,
        naming the plugins). Returns ``rollout/failed_episodes``, ``rollout/failed_step`` and
        ``rollout/failed_steps_total``; raises :class:`FailedStepsError` at the limit."""
        happened = episodes > 0 and failed >= episodes
        self.count(happened)
        metrics = {
            "rollout/failed_episodes": float(failed),
            "rollout/failed_step": float(happened),
            "rollout/failed_steps_total": float(self.total),
        }
        if not happened:
            return metrics
        message = (
            f"step {step}: every episode failed ({failed} of {episodes}: {why or 'marked failed by the workflow'}); "
            f"{self.streak} such step(s) in a row, {self.total} in all"
        )
        if self.limit and self.streak >= self.limit:
            raise FailedStepsError(
                f"{message}; that reaches algorithm.max_consecutive_failed_steps={self.limit}, so the run ends, "
                "keeping its last checkpoint: fix what fails, or raise the limit (0: none)"
            )
        warn(message)
        return metrics
