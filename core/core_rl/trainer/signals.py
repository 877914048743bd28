"""SIGINT and SIGTERM: stop after the current step, with a checkpoint; a second one stops at once.

Inside :class:`StopSignals` the first SIGINT or SIGTERM only records a request (:attr:`requested`);
the loop finishes its step, saves a checkpoint, closes loggers and engines and raises
:class:`~core_rl.trainer.errors.TrainingInterrupted`. A second signal restores the default action
and re-sends itself, so the process ends at once (exit status 128 + the signal's number), without
saving. A repeat within :data:`REPEAT_WINDOW_S` of the first counts as the same request: a launcher
that forwards the terminal's Ctrl-C to its workers, which got it from the terminal too, or a
scheduler that signals every process of a job, must not turn one request into "stop at once".
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any

#: a second signal this soon after the first is taken as a duplicate of it
REPEAT_WINDOW_S = 1.0

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager installing the handlers (in the main thread only; elsewhere it does
    nothing). ``announce``: print what happens on the first signal (rank 0 does, the others not)."""

    def __init__(self, *, announce: bool = True) -> None:
        self.announce = announce
        self.requested: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.requested is None:
            self.requested = name
            self._first_at = now
            if self.announce:
                _say(
                    f"core-rl: received {name}: finishing the current step, then saving a checkpoint and "
                    f"stopping (send {name} again to stop at once, without saving)"
                )
            return
        if now - self._first_at < REPEAT_WINDOW_S:
            return
        _say(f"core-rl: received {name} again: stopping at once, without saving")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _say(message: str) -> None:
    """Write to stderr from a signal handler (``print`` may be in the middle of a write)."""
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass
