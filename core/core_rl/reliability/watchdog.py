"""The progress watchdog: a run that stops advancing is stopped, saying where it is stuck.

Every process of a run (each rank under ``torchrun`` or the Ray launcher, or the one process of a
single-process run) runs a watchdog thread while the training loop runs (:class:`Watchdog`). It reads
the process's tracker (:data:`core_rl.reliability.progress.PROGRESS`: the phase of the step and the plugin,
engine and server calls in flight) and shares advances with the other ranks through a counter in
the run's rendezvous store, so a rank that only waits in a collective while another works is not
taken for stuck. When no rank has advanced for longer than the bound (:func:`bound`,
``trainer.watchdog``):

1. the rank that notices first (rank 0 when it can) declares the hang in the store; every rank
   then writes what it is doing, with the stack of each of its threads, to the store: its phase, the
   call in flight, and whether its main thread is blocked in a ``torch.distributed`` collective
   (and what that waits for, :func:`core_rl.launch.ranks.waiting_for`);
2. the declaring rank writes them all, rank by rank, to ``<run>/hang-<UTC time>.txt`` (a rank that
   did not answer within :data:`COLLECT_S` is named as such: its process may be frozen in native
   code), prints one line naming the stuck rank, phase and call, with the file's path, and exits
   with status 1; the other ranks exit with status 1 without a message of their own. Exits are
   ``os._exit`` after the output is flushed (within a bound): a stuck thread cannot hold them up.

A single-process run does the same without the store. Signals that arrive while the watchdog stops
the run are ignored (:meth:`core_rl.loops.signals.StopSignals.silence`): the launcher's SIGTERM to
the other ranks must not start a checkpoint.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import attrs

from core_rl.checkpoint.atomic import atomic_file
from core_rl.config.schema import WatchdogConfig
from core_rl.loops.signals import StopSignals, exit_now, say
from core_rl.reliability import exit_note
from core_rl.reliability.progress import PROGRESS, STEP, Progress, Snapshot

#: how long the declaring rank waits for the other ranks' reports
COLLECT_S = 30.0
#: added to the progress counter in the store to tell every rank a hang was declared
HANG_MARK = 1 << 40
#: the exit status of a run the watchdog stopped
EXIT_STUCK = 1
#: how long the other ranks stay after the declaring rank exited (launchers name the first to exit)
LINGER_S = 1.5


def bound(config: WatchdogConfig, progress: Progress, phase: str) -> tuple[float, str]:
    """The watchdog's bound while in ``phase``, in seconds, and the setting it comes from (see
    :class:`~core_rl.config.schema.WatchdogConfig`)."""
    if config.timeout_s is not None:
        return config.timeout_s, "trainer.watchdog.timeout_s"
    steps = list(progress.step_durations)
    seen = progress.phase_longest(phase)
    if phase == STEP and steps:  # the step itself, outside its named phases: known once a step was timed
        seen = 0.0
    longest = max([*steps, seen or 0.0])
    derived = config.factor * longest
    if not steps or seen is None:
        value = max(config.floor_s, config.first_s, derived)
        return value, "trainer.watchdog.first_s" if value == config.first_s else "trainer.watchdog.floor_s"
    if derived > config.floor_s:
        return derived, f"trainer.watchdog.factor {config.factor:g} x the longest recent step ({longest:.0f} s)"
    return config.floor_s, "trainer.watchdog.floor_s"


# -- what a process reports --------------------------------------------------------------------


@attrs.define
class Report:
    """One rank's part of a hang diagnosis: where it is (``snapshot`` fields), the collective its
    main thread is blocked in (``collective``, empty if none), where its main thread is
    (``main_at``: ``file:line in function``), and ``stacks``: every thread's stack as text."""

    rank: int
    pid: int
    host: str
    where: str
    phase: str
    phase_s: float
    calls: list[tuple[str, float, str]]
    waiting: str
    collective: str
    main_at: str
    stacks: str

    @classmethod
    def of_this_process(cls, rank: int, snapshot: Snapshot) -> Report:
        frames = sys._current_frames()
        main = frames.get(threading.main_thread().ident or -1)
        return cls(
            rank=rank,
            pid=os.getpid(),
            host=socket.gethostname(),
            where=snapshot.where(),
            phase=snapshot.phase,
            phase_s=snapshot.phase_s,
            calls=[(c.label, c.age_s, c.thread) for c in snapshot.calls],
            waiting=snapshot.waiting,
            collective=collective_of(main),
            main_at=_frame_text(main),
            stacks=thread_stacks(frames),
        )

    def section(self) -> str:
        """This rank's part of the hang file."""
        lines = [
            f"== rank {self.rank} (pid {self.pid} on {self.host}) ==",
            f"phase: {self.where}, for {self.phase_s:.0f} s",
        ]
        if self.collective:
            waits = f", waiting for {self.waiting}" if self.waiting else ""
            lines.append(f"main thread: blocked in a collective ({self.collective}){waits}")
        else:
            lines.append(f"main thread: at {self.main_at}")
        if self.calls:
            lines.append("calls in flight (oldest first):")
            same: dict[tuple[str, str], list[float]] = {}
            for label, age, thread in self.calls:
                same.setdefault((label, thread), []).append(age)
            for (label, thread), ages in same.items():
                times = f"{len(ages)} x " if len(ages) > 1 else ""
                lines.append(f"  {max(ages):7.1f} s  {times}{label}  [thread {thread}]")
        else:
            lines.append("calls in flight: none")
        return "\n".join([*lines, "", self.stacks])

    def stuck_text(self) -> str:
        """``rank 1 is stuck in update of step 2, in <call> for 61 s``."""
        text = f"rank {self.rank} is stuck in {self.where}"
        if self.calls:
            label, age, _ = self.calls[0]
            text += f", in {label} for {age:.0f} s"
        elif not self.collective:
            text += f", at {self.main_at}"
        return text


def collective_of(frame: FrameType | None) -> str:
    """The ``torch.distributed`` function the stack ending in ``frame`` is blocked in (its
    innermost frame in that package), or empty."""
    current = frame
    while current is not None:
        path = current.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in path:
            module = path.rsplit("/torch/distributed/", 1)[1].removesuffix(".py").replace("/", ".")
            return f"torch.distributed.{module}.{current.f_code.co_name}"
        current = current.f_back
    return ""


def _frame_text(frame: FrameType | None) -> str:
    if frame is None:
        return "an unknown place"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def thread_stacks(frames: dict[int, FrameType]) -> str:
    """Every Python thread's stack, named, the main thread first (as ``faulthandler`` would show
    them, with the source lines)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: (ident != main, names.get(ident, "")))
    parts = []
    for ident in order:
        header = f"Thread {names.get(ident, '(not started by threading)')} (id {ident}):"
        parts.append(header + "\n" + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


def summary_line(reports: list[Report], missing: list[int], quiet_s: float, limit: str, path: Path) -> str:
    """The one line the run ends with: the stuck ranks (those whose main thread is not blocked in
    a collective; all of them when every one is), who waits for them, who did not answer."""
    stuck = [r for r in reports if not r.collective] or reports
    waiting = [r for r in reports if r not in stuck]
    parts = [r.stuck_text() for r in stuck]
    if waiting:
        ranks = ", ".join(str(r.rank) for r in waiting)
        names = ", ".join(sorted({r.collective.rsplit(".", 1)[-1] for r in waiting}))
        waits = "waits for it in" if len(waiting) == 1 else "wait for it in"
        parts.append(f"{'rank' if len(waiting) == 1 else 'ranks'} {ranks} {waits} a collective ({names})")
    if missing:
        ranks = ", ".join(map(str, missing))
        parts.append(f"{'rank' if len(missing) == 1 else 'ranks'} {ranks} did not answer (frozen?)")
    return f"no progress for {quiet_s:.0f} s ({limit}): {'; '.join(parts)}. Every thread's stack on every rank: {path}"


def hang_file_text(reports: list[Report], missing: list[int], line: str, when: str) -> str:
    head = [f"core-rl hang diagnosis, {when}", line, ""]
    body = [r.section() for r in sorted(reports, key=lambda r: r.rank)]
    body += [f"== rank {r} ==\nno answer within {COLLECT_S:g} s (its process may be frozen, or gone)" for r in missing]
    return "\n".join(head) + "\n" + "\n\n".join(body)


# -- the store the ranks share -----------------------------------------------------------------


class SharedStore:
    """Keys of one run's watchdogs in the rendezvous store (a client connection of its own, so a
    main thread blocked in the store cannot block the watchdog). Every operation returns ``None``
    (and the store is dropped) when the store fails: the watchdog then watches its own process."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    @classmethod
    def connect(cls, world_size: int) -> SharedStore | None:
        if world_size <= 1:
            return None
        import torch.distributed as dist

        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"core-rl/watchdog/{run}/{attempt}/"
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        store: Any = None
        if addr and port:
            try:
                store = dist.TCPStore(
                    addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
                )
            except Exception:  # not a TCP store there: the process group's own
                store = None
        if store is None:
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:
                return None
        return cls(store, prefix)

    def _do(self, method: str, key: str, *args: Any) -> Any:
        if self.store is None:
            return None
        try:
            return getattr(self.store, method)(self.prefix + key, *args)
        except Exception:
            self.store = None
            return None

    def add(self, key: str, amount: int) -> int | None:
        return self._do("add", key, amount)

    def set(self, key: str, value: str) -> None:
        self._do("set", key, value)

    def get(self, key: str) -> str | None:
        value = self._do("get", key)
        return None if value is None else value.decode("utf-8", errors="replace")

    def has(self, key: str) -> bool:
        if self.store is None:
            return False
        try:
            return bool(self.store.check([self.prefix + key]))
        except Exception:
            self.store = None
            return False


# -- the watchdog thread -----------------------------------------------------------------------


class Watchdog:
    """Context manager: the watchdog thread of this process for the body (see the module
    docstring); nothing when ``config.enabled`` is false. ``stop``: the run's signal handlers,
    silenced while the watchdog stops the run."""

    def __init__(
        self,
        config: WatchdogConfig,
        run_dir: Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        stop: StopSignals | None = None,
        progress: Progress = PROGRESS,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.signals = stop
        self.progress = progress
        self.shared: SharedStore | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        if self.config.enabled:
            self.shared = SharedStore.connect(self.world_size)
            self._thread = threading.Thread(target=self._watch, name="core-rl-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def poll_s(self, limit: float) -> float:
        """How often to look: a twentieth of the bound, between 0.2 and 5 s."""
        return min(5.0, max(0.2, limit / 20))

    def _watch(self) -> None:
        seen_local = self.progress.advances
        seen_total: int | None = None
        quiet_since = time.monotonic()
        claimed_by_other: float | None = None
        poll = self.poll_s(bound(self.config, self.progress, self.progress.current_phase)[0])
        while not self._done.wait(poll):
            local = self.progress.advances
            moved = local != seen_local
            seen_local = local
            if self.shared is not None:
                total = self.shared.add("progress", 1 if moved else 0)
                if total is not None and total >= HANG_MARK:
                    self._stop_run(declared_by_me=False, quiet_s=time.monotonic() - quiet_since, limit="")
                    return
                if total is not None and total != seen_total:
                    moved = moved or seen_total is not None
                    seen_total = total
            now = time.monotonic()
            if moved:
                quiet_since = now
            limit_s, source = bound(self.config, self.progress, self.progress.current_phase)
            poll = self.poll_s(limit_s)
            patience = 0.0 if self.rank == 0 else 2 * poll  # rank 0 declares when it can (it owns the run dir)
            if now - quiet_since <= limit_s + patience:
                continue
            if self.shared is not None and claimed_by_other is None:
                if self.shared.add("claim", 1) not in (None, 1):
                    claimed_by_other = now  # another rank declares it at this moment: its mark comes next
                    continue
            elif claimed_by_other is not None and now - claimed_by_other < COLLECT_S:
                continue  # (the rank that claimed it never declared it: this one does)
            limit = f"the watchdog's bound: {limit_s:.0f} s, {source}"
            self._stop_run(declared_by_me=True, quiet_s=now - quiet_since, limit=limit)
            return

    def _stop_run(self, *, declared_by_me: bool, quiet_s: float, limit: str) -> None:
        """Report, write the hang file (declaring rank), and exit (see the module docstring)."""
        if self.signals is not None:
            self.signals.silence()
        shared = self.shared
        when = datetime.datetime.now(datetime.UTC)
        info = {"tag": when.strftime("%Y%m%dT%H%M%SZ"), "when": when.isoformat(timespec="seconds")}
        info.update(quiet_s=quiet_s, limit=limit)
        if declared_by_me and shared is not None:
            shared.set("info", json.dumps(info))
            shared.add("progress", HANG_MARK)
        report = Report.of_this_process(self.rank, self.progress.snapshot())
        if shared is not None:
            shared.set(f"report/{self.rank}", json.dumps(attrs.asdict(report)))
        if not declared_by_me:  # the declaring rank speaks and exits first, so launchers name it
            deadline = time.monotonic() + COLLECT_S + 10
            while shared is not None and not shared.has("done") and time.monotonic() < deadline:
                time.sleep(0.2)
            line = shared.get("done") if shared is not None and shared.has("done") else None
            exit_note.write(line or "stopped by the progress watchdog of another rank (its message says where)")
            time.sleep(LINGER_S)
            exit_now(EXIT_STUCK)
        reports, missing = [report], []
        if shared is not None:
            reports, missing = self._collect(shared, report)
        path = self.run_dir / f"hang-{info['tag']}.txt"
        line = summary_line(reports, missing, quiet_s, limit, path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as tmp:
                tmp.write_text(hang_file_text(reports, missing, line, info["when"]), encoding="utf-8")
        except OSError as exc:
            line += f" (could not be written: {exc})"
        say(f"core-rl: error: {line}")
        exit_note.write(line)
        if shared is not None:
            shared.set("done", line)
        exit_now(EXIT_STUCK)

    def _collect(self, shared: SharedStore, own: Report) -> tuple[list[Report], list[int]]:
        """Every rank's report that arrives within :data:`COLLECT_S`; the ranks that sent none."""
        reports = {own.rank: own}
        deadline = time.monotonic() + COLLECT_S
        while len(reports) < self.world_size and time.monotonic() < deadline and shared.store is not None:
            for rank in range(self.world_size):
                if rank not in reports and shared.has(f"report/{rank}"):
                    text = shared.get(f"report/{rank}")
                    if text is not None:
                        reports[rank] = Report(**json.loads(text))
            time.sleep(0.2)
        missing = [r for r in range(self.world_size) if r not in reports]
        return [reports[r] for r in sorted(reports)], missing
