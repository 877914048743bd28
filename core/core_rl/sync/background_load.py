"""A weight load into the rollout engine that runs beside the trainer.

In an asynchronous run (``rollout.controller.max_head_offpolicyness`` >= 1) with
``rollout.weight_sync: disk``, the trainer writes version ``k`` and goes on to step ``k + 1``
while the rollout engine loads it (the controller paused around the load, as for a blocking one):
the load's time leaves the trainer's critical path. The trainer waits for it only before it
writes the next version into the same directory, saves a checkpoint or ends the run. At most one
load is in flight; its error, if any, is raised where the trainer waits for it.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable

from core_rl.rollout.controller import RolloutTimeout


class BackgroundWeightLoad:
    """At most one ``load()`` running in a thread of its own; :meth:`wait` joins it.

    :param timeout_s: how long :meth:`wait` waits before it raises :class:`RolloutTimeout`.
    :param timeout_key: the config key of ``timeout_s``, for the error.
    """

    def __init__(self, timeout_s: float, timeout_key: str) -> None:
        self.timeout_s, self.timeout_key = timeout_s, timeout_key
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: tuple[int, concurrent.futures.Future[float]] | None = None
        #: seconds the last finished load took (0 before the first)
        self.last_load_s = 0.0

    def start(self, load: Callable[[], None], version: int) -> None:
        """Run ``load()`` (which loads ``version``) in the background; the previous load must
        have been waited for."""
        if self._pending is not None:
            raise RuntimeError(f"weight load of version {self._pending[0]} still pending")
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-load")

        def timed() -> float:
            t0 = time.perf_counter()
            load()
            return time.perf_counter() - t0

        self._pending = (version, self._executor.submit(timed))

    def wait(self) -> float:
        """Wait for the load in flight (if any); return the seconds waited. Raises the load's own
        error, or :class:`RolloutTimeout` after ``timeout_s``."""
        if self._pending is None:
            return 0.0
        version, future = self._pending
        t0 = time.perf_counter()
        try:
            self.last_load_s = future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise RolloutTimeout(
                f"waited {self.timeout_s:g} s for the rollout engine to load the weights of version {version} "
                f"({self.timeout_key}); it is still loading"
            ) from None
        finally:
            if future.done():
                self._pending = None
        return time.perf_counter() - t0

    def close(self, timeout_s: float = 30.0) -> None:
        """Let a load in flight finish (at most ``timeout_s``, its error dropped: the run is
        ending) and stop the thread."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending[1]], timeout_s)
            self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
