"""SIGINT and SIGTERM: stop after the current step, with a checkpoint, within a grace period; a
second one stops at once.

Inside :class:`StopSignals` the first SIGINT or SIGTERM only records a request (:attr:`requested`);
the loop finishes its step, saves a checkpoint, closes loggers and engines and raises
:class:`~core_rl.loops.errors.TrainingInterrupted`. A second signal stops the process at once,
without saving (exit status 128 + the signal's number). A repeat within :data:`REPEAT_WINDOW_S` of
the first counts as the same request: a launcher that forwards the terminal's Ctrl-C to its
workers, which got it from the terminal too, or a scheduler that signals every process of a job,
must not turn one request into "stop at once".

The grace period (``grace_s``, ``trainer.stop_grace_s``): when the step has not finished and been
saved that long after the first signal (a stuck step), the process says so, naming the phase and
call it is stuck in and the newest complete checkpoint (which stays as it was: a save in progress
writes to a ``.partial`` directory, removed when the run resumes), and exits with 128 + the
signal's number without saving. If the checkpoint was saved and only closing the engines is slow,
it exits with status 3, as a stop that saved does.

A signal reaches Python's handler only when the main thread runs Python code, which a main thread
blocked in native code (a collective, a stuck call) does not. So the handlers also write each
signal's number to a pipe (:func:`signal.set_wakeup_fd`), read by a thread of their own that keeps
the grace period and acts on a signal the main thread has not taken within :data:`HANDOFF_S`
(exiting with ``os._exit`` where the main thread would re-send the signal to itself). Each signal
is acted on once, by whichever thread takes it first.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from core_rl.reliability import exit_note

#: a second signal this soon after the first is taken as a duplicate of it
REPEAT_WINDOW_S = 1.0
#: how long the signal thread leaves a signal to the main thread's handler before acting on it
HANDOFF_S = 0.5
#: how long the output may take to flush before a process that must stop exits anyway
FLUSH_S = 2.0

HANDLED = (signal.SIGINT, signal.SIGTERM)
#: how the message of a stop past the grace period begins (a launcher looks for it in the ranks' notes)
NOT_SAVED = "the current step did not finish within"


class StopSignals:
    """Context manager installing the handlers (in the main thread only; elsewhere it does
    nothing). ``announce``: print what happens on the first signal and when the grace period runs
    out (rank 0 does, the others not); ``grace_s``: the grace period (``None``: none);
    ``run_dir``: the run directory whose newest checkpoint the message names."""

    def __init__(self, *, announce: bool = True, grace_s: float | None = None, run_dir: Path | None = None) -> None:
        self.announce = announce
        self.grace_s = grace_s
        self.run_dir = run_dir
        self.requested: str | None = None
        self._first_at = 0.0
        self._first_signal = 0
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._acting = threading.RLock()  # one signal acted on at a time, in order
        #: signals the pipe delivered and nobody acted on yet: (number, when it arrived)
        self._pending: list[tuple[int, float]] = []
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._silenced = False
        self._deadline: float | None = None
        self._saved: str | None = None

    # -- the run tells it ----------------------------------------------------------------------

    def silence(self) -> None:
        """Ignore every signal from now on, and end the grace period: the process is stopping
        for another reason (:mod:`core_rl.reliability.watchdog`)."""
        self._silenced = True
        self._deadline = None

    def saved(self, message: str) -> None:
        """The stop was honoured: ``message`` says what was saved. Past the grace period only
        closing the engines is slow: the process then exits with status 3 (module docstring)."""
        self._saved = message

    # -- installing ----------------------------------------------------------------------------

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            read_end, write_end = os.pipe()
        except OSError:
            return self
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read_end)
            os.close(write_end)
            return self
        self._pipe = (read_end, write_end)
        self._thread = threading.Thread(target=self._watch, name="core-rl-signals", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._pipe is not None:
            try:
                signal.set_wakeup_fd(self._old_wakeup)
            except (ValueError, OSError):
                signal.set_wakeup_fd(-1)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    # -- taking a signal -----------------------------------------------------------------------

    def _drain(self) -> None:
        """Move the signal numbers waiting in the pipe to :attr:`_pending` (under the lock)."""
        if self._pipe is None:
            return
        now = time.monotonic()
        while True:
            try:
                data = os.read(self._pipe[0], 64)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            self._pending += [(n, now) for n in data if n in HANDLED]

    def _pipe_is_ours(self) -> bool:
        """Whether the wakeup pipe is still ours (another library may have set its own since)."""
        if self._pipe is None:
            return False
        current = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        if current != self._pipe[1]:
            signal.set_wakeup_fd(current)
            return False
        return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Python's handler, in the main thread: act on the signals the pipe holds (or on this
        one, without a pipe of ours)."""
        with self._lock:
            self._drain()
            if not self._pending and not self._pipe_is_ours():
                self._pending.append((signum, time.monotonic()))
            taken, self._pending = self._pending, []
        for number, at in taken:
            self._act(number, at, main_thread=True)

    def _watch(self) -> None:
        """The signal thread: signals the main thread did not take, and the grace period."""
        assert self._pipe is not None
        while not self._closing.is_set():
            wait = 0.2
            if self._deadline is not None:
                wait = min(wait, max(0.0, self._deadline - time.monotonic()))
            try:
                select.select([self._pipe[0]], [], [], wait)
            except (OSError, ValueError):
                return
            now = time.monotonic()
            with self._lock:
                self._drain()
                taken: list[tuple[int, float]] = []
                if self._pending and now - self._pending[0][1] >= HANDOFF_S:
                    taken, self._pending = self._pending, []
            for number, at in taken:
                self._act(number, at, main_thread=False)
            if self._deadline is not None and time.monotonic() >= self._deadline and not self._silenced:
                self._grace_over()

    def _act(self, signum: int, at: float, *, main_thread: bool) -> None:
        """What signal ``signum``, arrived at ``at``, means (module docstring)."""
        with self._acting:
            self._act_locked(signum, at, main_thread=main_thread)

    def _act_locked(self, signum: int, at: float, *, main_thread: bool) -> None:
        if self._silenced:
            return
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            self._first_at = at
            self._first_signal = signum
            if self.grace_s is not None:
                self._deadline = at + self.grace_s
            if self.announce:
                grace = ""
                if self.grace_s is not None:
                    grace = f"; past trainer.stop_grace_s ({self.grace_s:g} s), stopping without saving"
                say(
                    f"core-rl: received {name}: finishing the current step, then saving a checkpoint and "
                    f"stopping (send {name} again to stop at once, without saving{grace})"
                )
            return
        if at - self._first_at < REPEAT_WINDOW_S:
            return
        say(f"core-rl: received {name} again: stopping at once, without saving")
        if main_thread:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        else:
            exit_now(128 + signum)

    def _grace_over(self) -> None:
        """The grace period ran out: stop now (module docstring)."""
        self._deadline = None
        grace = f"trainer.stop_grace_s ({self.grace_s:g} s)"
        if self._saved is not None:
            if self.announce:
                say(f"core-rl: {self._saved}; closing the engines took longer than {grace}: stopping now")
            exit_now(3)
        message = (
            f"{NOT_SAVED} {grace} of {self.requested}: stopping without saving ({stuck_where()}). "
            f"{checkpoint_note(self.run_dir)}"
        )
        if self.announce:
            say(f"core-rl: {message}")
        exit_note.write(message)
        exit_now(128 + self._first_signal)


def stuck_where() -> str:
    """``stuck in update of step 3, in <the oldest call in flight> for 70 s`` (:mod:`core_rl.reliability.progress`)."""
    from core_rl.reliability.progress import PROGRESS

    snapshot = PROGRESS.snapshot()
    text = f"stuck in {snapshot.where()}"
    if snapshot.calls:
        text += f", in {snapshot.calls[0].label} for {snapshot.calls[0].age_s:.0f} s"
    return text


def checkpoint_note(run_dir: Path | None) -> str:
    """Which checkpoint stays the run's newest, and what becomes of a save that was under way."""
    if run_dir is None:
        return ""
    from core_rl.checkpoint import store as checkpoints

    latest = checkpoints.latest_checkpoint(run_dir)
    if latest is None:
        note = "No checkpoint was saved before; the run starts from the beginning when run again"
    else:
        note = f"The newest complete checkpoint is {latest}, as it was; continue from it with recover.mode=auto"
    root = checkpoints.checkpoints_root(run_dir)
    partial = sorted(root.glob(".step_*.partial")) if root.is_dir() else []
    if partial:
        note += f" (the unfinished save in {partial[-1]} is removed when the run resumes)"
    return note


def say(message: str) -> None:
    """Write a line to stderr directly (``print`` may be in the middle of a write, or another
    thread may hold ``sys.stderr``)."""
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass


def exit_now(code: int) -> None:
    """Flush what the process printed (for at most :data:`FLUSH_S`: a stuck thread may hold a
    stream) and end the process at once with status ``code``, from any thread."""
    flusher = threading.Thread(target=_flush, args=((sys.stdout, sys.stderr),), daemon=True)
    flusher.start()
    flusher.join(FLUSH_S)
    os._exit(code)


def _flush(streams: Iterable[Any]) -> None:
    for stream in streams:
        try:
            stream.flush()
        except Exception:
            pass
