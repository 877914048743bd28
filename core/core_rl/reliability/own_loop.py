"""An event loop of its own, in a daemon thread, for one plugin object's coroutines.

An ``async def`` plugin method that makes a blocking call (``time.sleep``, a blocking socket)
blocks the event loop it runs on. Run on the rollout controller's loop, it would freeze every
trajectory and every timeout there (``asyncio.wait_for`` cannot fire while the loop is blocked).
:class:`OwnLoop` runs such coroutines on a loop of their own instead, in a daemon thread; the
caller awaits the result on its loop with a timeout, which fires whatever the coroutine does.

One :class:`OwnLoop` serves one plugin object (an environment of one trajectory), so the object's
loop-bound state (subprocesses, connections, locks) stays on one loop across its calls. A call that
timed out leaves the loop blocked for good (:attr:`OwnLoop.stuck`): later calls are refused and its
thread is left to the process's exit (a daemon never keeps it alive). :func:`stuck_loops` counts
such threads still alive, so that a plugin that hangs on every call stops the run instead of
piling up threads. Light: no torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: the threads of loops that timed out, kept while they are alive (:func:`stuck_loops`)
_STUCK: list[threading.Thread] = []
_STUCK_LOCK = threading.Lock()
#: how long a loop has, after a call on it timed out, to show it still runs (else it is stuck)
PROBE_S = 1.0


def awaitable_error(exc: BaseException) -> BaseException:
    """``exc`` as an asyncio future can hold it. asyncio refuses a ``StopIteration`` (a synchronous
    ``next()`` on an empty iterator, raised in a thread): copied into the future a coroutine awaits
    (``run_in_executor``, ``wrap_future``), it is dropped with a logged ``TypeError`` and the
    coroutine waits for ever. So it becomes a ``RuntimeError`` naming it, with it as the cause."""
    if isinstance(exc, StopIteration):
        error = RuntimeError(f"StopIteration raised: {exc!r}")
        error.__cause__ = exc
        return error
    return exc


def stuck_loops() -> int:
    """Loops whose call timed out and whose thread is still blocked, in this process."""
    with _STUCK_LOCK:
        _STUCK[:] = [t for t in _STUCK if t.is_alive()]
        return len(_STUCK)


class OwnLoop:
    """See the module docstring. ``name`` names the thread (for stacks in a watchdog report)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stuck = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=_serve, args=(self._loop,), name=self.name[:60], daemon=True)
            self._thread.start()
        return self._loop

    async def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """``await coro`` on this loop, at most ``timeout_s`` seconds as the calling loop counts
        them; raises :class:`TimeoutError` past that, and the coroutine's own exception as it is.
        A timed-out coroutine is cancelled; when the loop does not answer within
        :data:`PROBE_S` after that (the coroutine blocks it), the loop is :attr:`stuck` and refuses
        every further call with :class:`TimeoutError` at once (``coro`` is closed unrun)."""
        if self.stuck:
            coro.close()
            raise TimeoutError("an earlier call on this loop never returned")
        loop = self._start()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            probe: concurrent.futures.Future[None] = concurrent.futures.Future()
            loop.call_soon_threadsafe(lambda: probe.done() or probe.set_result(None))
            try:
                await asyncio.wait_for(asyncio.wrap_future(probe), PROBE_S)
            except TimeoutError:
                self.stuck = True
                if self._thread is not None:
                    with _STUCK_LOCK:
                        _STUCK.append(self._thread)
            raise

    def close(self) -> None:
        """Stop the loop and let its thread end (a stuck loop's thread ends if the call blocking it
        ever returns)."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's thread: run it until :meth:`OwnLoop.close` stops it, then close it."""
    try:
        loop.run_forever()
    finally:
        loop.close()
