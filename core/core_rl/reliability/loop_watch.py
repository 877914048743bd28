"""Watching an event loop for stalls: code that blocks the loop it runs on.

An ``async def`` that makes a blocking call (``time.sleep``, a blocking socket) keeps its event loop
from running anything else, its own timeouts included. :class:`LoopWatch` notices from outside: a
daemon thread posts a heartbeat to the loop every :data:`BEAT_S` seconds, and the loop is *stalled*
when the last one posted has waited more than ``stall_s`` to run. :meth:`LoopWatch.stalled` then
says so in one line, naming where the loop's thread is (the innermost frame of its stack outside
the standard library, as ``file:line in function``), which is the blocking code. Light: no torch.
"""

from __future__ import annotations

import asyncio
import sys
import sysconfig
import threading
import time

#: how often the heartbeat is posted
BEAT_S = 0.5


class LoopWatch:
    """Watches ``loop``, run by ``thread``, for stalls longer than ``stall_s`` (see the module
    docstring). :meth:`stop` ends the watch (also a daemon thread: it never keeps a process alive)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread, stall_s: float) -> None:
        self.loop = loop
        self.thread = thread
        self.stall_s = stall_s
        #: when the oldest heartbeat not yet run was posted (``None``: none waits)
        self._waiting_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="core-rl-loop-watch", daemon=True)
        self._watcher.start()

    def _beat(self) -> None:
        with self._lock:
            self._waiting_since = None

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S):
            with self._lock:
                if self._waiting_since is not None:
                    continue  # the last heartbeat has not run yet
                self._waiting_since = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(self._beat)
            except RuntimeError:  # the loop was closed
                return

    def stalled_s(self) -> float:
        """How long the loop has not run its heartbeat (0 when it runs)."""
        with self._lock:
            since = self._waiting_since
        return 0.0 if since is None else time.monotonic() - since

    def stalled(self) -> str | None:
        """``None`` while the loop runs; once it stalled past ``stall_s``: ``blocked for N s in
        <file>:<line> in <function>`` (where its thread is now)."""
        waited = self.stalled_s()
        if waited <= self.stall_s:
            return None
        return f"blocked for {waited:.0f} s in {self.where()}"

    def where(self) -> str:
        """Where the loop's thread is: ``file:line in function`` of the innermost frame of its
        stack outside Python's standard library (the code that called ``time.sleep`` or
        ``Event.wait``), else of the innermost frame."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        if frame is None:
            return "(its thread has ended)"
        found = frame
        while found is not None and _in_stdlib(found.f_code.co_filename):
            found = found.f_back
        shown = found if found is not None else frame
        return f"{shown.f_code.co_filename}:{shown.f_lineno} in {shown.f_code.co_name}"

    def stop(self) -> None:
        """End the watch (its thread stops within :data:`BEAT_S`)."""
        self._stop.set()


def _in_stdlib(filename: str) -> bool:
    """Whether ``filename`` is a module of Python's standard library (not an installed package)."""
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    return filename.startswith(sysconfig.get_paths()["stdlib"])
