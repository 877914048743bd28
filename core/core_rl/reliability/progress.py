"""Where a process of a run is: the phase of the step it is in and the calls it has in flight,
read by the progress watchdog (:mod:`core_rl.reliability.watchdog`) to tell a run that is slow from one
that is stuck, and to say where.

The loop and its stages set the phase (:meth:`Progress.phase`: ``rollout``, ``reward``,
``update``, ``collective``, ``sync``, ``checkpoint``, ``evaluation``, ``logging``, ``export``)
and register each plugin, engine or server call while it runs (:meth:`Progress.call`, e.g.
``vllm server vllm-0 (http://127.0.0.1:8000): generation request: POST .../v1/completions``). A call
registered inside another one, in the same thread or asyncio task, is shown as part of it. Every
phase that starts or ends and every call that returns counts as an advance (:attr:`Progress.advances`);
the watchdog's clock is the time since the last one. :meth:`Progress.begin_step` and
:meth:`Progress.end_step` time the steps, from which the watchdog derives its bound.

Light: no torch, so the rollout engines' HTTP code and the guards use it. There is one tracker per
process, :data:`PROGRESS`.

Test hook: ``CORE_RL_TEST_STALL=RANK:STEP:TEXT`` makes the process of rank ``RANK`` (its ``RANK``
variable, 0 without one) stop for good inside the first call whose label contains ``TEXT`` during
step ``STEP``: a rank stuck inside a step, which the fault tests need and no real part produces on
demand. With ``CORE_RL_TEST_STALL_MARKER=PATH`` too, it first creates the file ``PATH``, so that a
test acts once the rank is stuck rather than after a guessed delay.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Iterator

import attrs

#: the test hook's variable (module docstring)
STALL_VARIABLE = "CORE_RL_TEST_STALL"
#: the file the test hook creates as it stops (module docstring)
STALL_MARKER_VARIABLE = "CORE_RL_TEST_STALL_MARKER"
#: how many recent step durations the bound is derived from
RECENT_STEPS = 20
#: the phase of a step outside every named one (and of the loop outside the steps)
STEP = "step"

#: the innermost call of the current thread or asyncio task (its id in :attr:`Progress._calls`)
_current_call: contextvars.ContextVar[int | None] = contextvars.ContextVar("core_rl_current_call", default=None)


@attrs.define
class Call:
    """A call in flight: its ``label``, when it started (``time.monotonic``), the thread that made
    it, and the call it was made inside (``parent``, an id; ``None``: none)."""

    label: str
    started: float
    thread: str
    parent: int | None = None


@attrs.frozen
class CallView:
    """A call in flight as the watchdog reports it: ``label`` (with the labels of the calls it
    runs inside, outermost first), ``age_s`` and ``thread``."""

    label: str
    age_s: float
    thread: str


@attrs.frozen
class Snapshot:
    """What a process was doing at one moment: the current ``step`` (``None`` outside the loop),
    ``phase`` and ``what`` (its detail, e.g. what a collective waits for), how long it has been in
    the phase, the innermost calls in flight (oldest first) and the seconds since the last advance."""

    step: int | None
    phase: str
    what: str
    phase_s: float
    calls: tuple[CallView, ...]
    quiet_s: float
    waiting: str = ""

    def where(self) -> str:
        """``update of step 3`` / ``collective of step 3 (rank 0 to send ...)``; ``step 3`` in
        none of the named phases."""
        if self.phase == STEP:
            text = f"step {self.step}" if self.step is not None else "the loop"
        else:
            text = self.phase + (f" of step {self.step}" if self.step is not None else "")
        return text + (f" ({self.what})" if self.what else "")


class Progress:
    """The tracker (see the module docstring). Thread-safe: the loop, the engines' threads and the
    watchdog all use it."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        """Begin as a process that has just started: no calls, phase ``starting`` from now."""
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._calls: dict[int, Call] = {}
        now = time.monotonic()
        self.step: int | None = None
        self.current_phase = "starting"
        self.what = ""
        self.phase_since = now
        #: advances so far, and when the last one happened
        self.advances = 0
        self.advanced_at = now
        #: durations of the recent steps (:meth:`end_step`), newest last
        self.step_durations: deque[float] = deque(maxlen=RECENT_STEPS)
        self._step_started: float | None = None
        #: the longest each phase took so far, by name (phases that ended at least once)
        self.longest: dict[str, float] = {}
        #: what the main thread's collectives wait for (:func:`core_rl.launch.ranks.waiting_for`), innermost last
        self.waits: list[str] = []
        #: the test hook, read at the first step (not at import: a process forked from one that
        #: imported this module may have set its environment since)
        self._stall: tuple[int, int, str] | None = None
        self._stall_read = False

    # -- what the loop reports ------------------------------------------------------------------

    def advance(self) -> None:
        """Count an advance (something finished that shows the run is moving)."""
        with self._lock:
            self._advance_locked()

    def _advance_locked(self) -> None:
        self.advances += 1
        self.advanced_at = time.monotonic()

    def begin_step(self, step: int) -> None:
        """Step ``step`` starts now; ends the timing of the previous one (its duration runs from
        its start to this one's, so its evaluation, logging and checkpoint count)."""
        with self._lock:
            now = time.monotonic()
            if self._step_started is not None:
                self.step_durations.append(now - self._step_started)
            self._step_started = now
            if not self._stall_read:
                self._stall, self._stall_read = _stall_spec(), True
            self.step = step
            self.current_phase, self.what, self.phase_since = STEP, "", now
            self._advance_locked()

    def end_loop(self) -> None:
        """The loop ended: the last step's time is counted, and there is no current step."""
        with self._lock:
            if self._step_started is not None:
                self.step_durations.append(time.monotonic() - self._step_started)
            self._step_started = None
            self.step = None
            self.current_phase, self.what, self.phase_since = "after the steps", "", time.monotonic()
            self._advance_locked()

    @contextlib.contextmanager
    def phase(self, name: str, what: str = "") -> Iterator[None]:
        """Be in phase ``name`` (``what``: its detail) for the body; the phase before comes back
        after it. Both count as advances; the body's duration is kept in :attr:`longest`."""
        with self._lock:
            before = (self.current_phase, self.what, self.phase_since)
            started = time.monotonic()
            self.current_phase, self.what, self.phase_since = name, what, started
            self._advance_locked()
        try:
            yield
        finally:
            with self._lock:
                took = time.monotonic() - started
                self.longest[name] = max(self.longest.get(name, 0.0), took)
                self.current_phase, self.what, self.phase_since = before
                self._advance_locked()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """The collectives in the body wait for ``what`` (the other ranks in the update of step 3,
        say): the watchdog names it for a rank whose main thread is blocked in one."""
        with self._lock:
            self.waits.append(what)
        try:
            yield
        finally:
            with self._lock:
                self.waits.pop()

    @contextlib.contextmanager
    def call(self, label: str) -> Iterator[None]:
        """Register a call named ``label`` for the body (usable around ``await`` in a coroutine:
        the innermost call is tracked per asyncio task). Its return counts as an advance."""
        parent = _current_call.get()
        with self._lock:
            key = next(self._ids)
            self._calls[key] = Call(label, time.monotonic(), threading.current_thread().name, parent)
        token = _current_call.set(key)
        try:
            if self._stall is not None:
                self._maybe_stall(label)
            yield
        finally:
            _current_call.reset(token)
            with self._lock:
                self._calls.pop(key, None)
                self._advance_locked()

    def _maybe_stall(self, label: str) -> None:
        """The test hook (module docstring): stop here for good."""
        assert self._stall is not None
        rank, step, text = self._stall
        if self.step == step and text in label and rank == int(os.environ.get("RANK", "0")):
            self._stall = None
            if marker := os.environ.get(STALL_MARKER_VARIABLE):
                with open(marker, "w"):
                    pass
            while True:
                time.sleep(3600)

    # -- what the watchdog reads ----------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The process's state now (:class:`Snapshot`)."""
        with self._lock:
            now = time.monotonic()
            calls = dict(self._calls)
            parents = {c.parent for c in calls.values() if c.parent is not None}
            views = []
            for key, call in calls.items():
                if key in parents:  # shown as part of the call made inside it
                    continue
                labels, outer = [call.label], call.parent
                while outer is not None and outer in calls:
                    labels.append(calls[outer].label)
                    outer = calls[outer].parent
                oldest = min(calls[k].started for k in _chain(key, calls))
                views.append(CallView(": ".join(reversed(labels)), now - oldest, call.thread))
            views.sort(key=lambda v: -v.age_s)
            return Snapshot(
                step=self.step,
                phase=self.current_phase,
                what=self.what,
                phase_s=now - self.phase_since,
                calls=tuple(views),
                quiet_s=now - self.advanced_at,
                waiting=self.waits[-1] if self.waits else "",
            )

    def phase_longest(self, name: str) -> float | None:
        """The longest phase ``name`` took so far (``None``: it has not ended yet in this process)."""
        with self._lock:
            return self.longest.get(name)


def _chain(key: int, calls: dict[int, Call]) -> Iterator[int]:
    """``key`` and the calls it runs inside, innermost first."""
    current: int | None = key
    while current is not None and current in calls:
        yield current
        current = calls[current].parent


def _stall_spec() -> tuple[int, int, str] | None:
    """The test hook's ``(rank, step, text)``, or ``None``."""
    value = os.environ.get(STALL_VARIABLE, "")
    if not value:
        return None
    rank, step, text = value.split(":", 2)
    return int(rank), int(step), text


#: this process's tracker; a forked child begins its own (the parent's calls, clocks and lock, which
#: another thread may have held at the fork, are not the child's)
PROGRESS = Progress()
os.register_at_fork(after_in_child=PROGRESS.start)
