"""When checkpoints are saved besides ``saver.every_n_steps``, and which are kept besides the
newest ``saver.keep_last``.

- ``saver.every_n_minutes`` (:class:`TimedSaves`): a checkpoint after the first step that ends at
  least that many minutes after the run started or after its newest checkpoint, for runs whose step
  time varies or is unknown. Rank 0's clock decides and every rank follows (one small broadcast per
  step while the option is on), so the ranks always save together.
- ``saver.keep_best`` (:class:`BestCheckpoints`): the ``count`` checkpoints with the best value of
  ``metric`` (``max`` or ``min``), among those whose step logged it, are kept whatever their age.
  A checkpoint's score is the value of ``metric`` logged at its step (evaluation metrics
  included: evaluation runs before the checkpoint of its step), kept in
  ``<run>/checkpoints/scores.json`` (written atomically, carried across resumes); a checkpoint whose
  step did not log it (a time-triggered one between evaluations, say) is never among the best.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from core_rl.checkpoint.atomic import write_text_atomic
from core_rl.checkpoint.store import checkpoint_dir, checkpoints_root, list_checkpoints
from core_rl.config.schema import KeepBestConfig
from core_rl.errors import did_you_mean, warn

SCORES_FILE = "scores.json"


class TimedSaves:
    """Rank 0's view of whether ``every_n_minutes`` have passed since the last checkpoint (or the
    start); :meth:`saved` restarts the count."""

    def __init__(self, every_n_minutes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_n_minutes * 60.0
        self.clock = clock
        self.last = clock()

    def due(self) -> bool:
        return self.every_s > 0 and self.clock() - self.last >= self.every_s

    def saved(self) -> None:
        self.last = self.clock()


class BestCheckpoints:
    """The scores of a run's checkpoints and the steps ``keep_best`` protects (module docstring)."""

    def __init__(self, config: KeepBestConfig, run_dir: Path) -> None:
        self.config = config
        self.path = checkpoints_root(run_dir) / SCORES_FILE
        self.scores: dict[int, float] = self._read()
        self.warned = False

    def _read(self) -> dict[int, float]:
        """The recorded scores of this metric (none when the file is absent or scored another)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("metric") != self.config.metric:
            return {}
        return {int(step): float(value) for step, value in data.get("scores", {}).items()}

    def record(self, step: int, metrics: Mapping[str, Any]) -> float | None:
        """Record checkpoint ``step``'s score from the metrics logged at that step (a finite number
        under ``metric``); return it, or ``None`` when the step did not log one. The first time a
        step logs no such metric at all, a warning names the metric and the closest one logged
        (a misspelt metric would otherwise never keep a checkpoint)."""
        metric = self.config.metric
        value = metrics.get(metric)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.scores.pop(step, None)
            if metric not in metrics and not self.warned:
                self.warned = True
                close = did_you_mean(metric, metrics)
                hint = f" (did you mean {close!r}?)" if close else ""
                warn(
                    f"saver.keep_best.metric: step {step} logged no {metric!r}{hint}; its checkpoint "
                    "is not ranked (only checkpoints of steps that log it are)"
                )
            return None
        self.scores[step] = float(value)
        body = {"metric": self.config.metric, "mode": self.config.mode, "scores": dict(sorted(self.scores.items()))}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(body, indent=1) + "\n")
        return float(value)

    def ranked(self, steps: Iterable[int]) -> list[tuple[int, float]]:
        """The scored ones of ``steps`` (existing checkpoints), best first (ties: the earlier step)."""
        sign = -1.0 if self.config.mode == "max" else 1.0
        scored = [(step, self.scores[step]) for step in steps if step in self.scores]
        return sorted(scored, key=lambda item: (sign * item[1], item[0]))

    def protected(self, steps: Iterable[int]) -> set[int]:
        """The ``count`` best of ``steps``."""
        return {step for step, _ in self.ranked(steps)[: self.config.count]}

    def best_line(self, run_dir: Path) -> str | None:
        """``best:       <checkpoint> (<metric> <value>, saver.keep_best)`` for the best checkpoint
        of ``run_dir`` that exists, or ``None`` when none is scored."""
        ranked = self.ranked(step for step, _ in list_checkpoints(run_dir))
        if not ranked:
            return None
        step, value = ranked[0]
        return f"best:       {checkpoint_dir(run_dir, step)} ({self.config.metric} {value:.4g}, saver.keep_best)"
