"""A logger whose per-step calls run under a deadline (``trainer.logger_timeout_s``).

:class:`DeadlineLogger` wraps each built logger (:func:`core_rl.loops.building.build_loggers`):
its hot calls, ``log`` (every step) and ``log_samples``, run through
:func:`core_rl.reliability.deadlines.call_with_deadline`, so a logger that blocks (a network call that never
returns, a full pipe) stops the run within the deadline with one line naming the logger, its
distribution, the call and the wait, instead of freezing it. The step being logged has not been
saved yet, so a resume continues from the checkpoint before it. ``start`` and ``close`` are called
directly, but ``close`` is skipped for a logger whose call never returned (it would block too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from core_rl.interfaces import Logger, RunInfo, SampleRecord
from core_rl.plugins.attribution import built_by
from core_rl.reliability.deadlines import DeadlinePassed, call_with_deadline

#: the config key of the deadline, named in messages
KEY = "trainer.logger_timeout_s"


class DeadlineLogger(Logger):
    """``inner`` with its ``log`` and ``log_samples`` bounded by ``timeout_s`` (see the module
    docstring); ``words`` name it (default: :func:`core_rl.plugins.attribution.built_by`)."""

    def __init__(self, inner: Logger, timeout_s: float, words: str = "") -> None:
        self.inner = inner
        self.timeout_s = timeout_s
        self.words = words or built_by(inner)
        self.stuck = False

    def _bounded(self, doing: str, fn, *args) -> None:
        try:
            call_with_deadline(self.words, doing, self.timeout_s, KEY, fn, *args)
        except DeadlinePassed:
            self.stuck = True
            raise

    def start(self, run: RunInfo) -> None:
        self.inner.start(run)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._bounded(f"log (step {step})", self.inner.log, metrics, step)

    def log_samples(self, samples: Sequence[SampleRecord], step: int) -> None:
        self._bounded(f"log_samples (step {step})", self.inner.log_samples, samples, step)

    def close(self) -> None:
        if not self.stuck:
            self.inner.close()
