"""Watching a running attempt until it ends (:func:`watch`) and stopping what is left of it
(:func:`stop_ranks`).

The launcher polls every actor every ``launcher.poll_s`` seconds, each answer bounded by
``launcher.actor_timeout_s``: a rank's exit, a rank's actor that died (``ray.kill``, its worker
crashed, its node was lost) or stopped answering, a server whose process ended, and the driver's
own SIGINT/SIGTERM each end the wait with an :class:`Outcome` naming the actor and its node; a
rank's exit also quotes the line its process ended with (its error, or the progress watchdog's
diagnosis of a stuck run, :mod:`core_rl.reliability.exit_note`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import attrs

from core_rl_ray.group import ActorGroup, ActorLost, Member, call

#: a rank's exit status after SIGINT/SIGTERM stopped it with a checkpoint
EXIT_INTERRUPTED = 3
#: the exit status of a user's mistake (configuration, data, ...): a restart cannot help
EXIT_USAGE = 2


@attrs.frozen
class Outcome:
    """How an attempt ended: ``code`` (0: every rank finished), ``message`` (what failed, naming
    the actor and node; empty on success), and whether a new attempt may succeed."""

    code: int
    message: str = ""
    retriable: bool = False


def _rank_exit(index: int, describe: str, code: int, note: str = "") -> Outcome:
    """The outcome of rank ``index`` (its actor: ``describe``) exiting with ``code``; ``note``: the
    line its process ended with (:mod:`core_rl.reliability.exit_note`), quoted instead of pointing above."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return Outcome(1, f"trainer rank {index} ({describe}) was killed by {name}", retriable=True)
    said = f": {note}" if note else " (its message is above)"
    if code == EXIT_INTERRUPTED:
        return Outcome(code, f"trainer rank {index} ({describe}) was stopped by a signal{said}")
    return Outcome(
        code, f"trainer rank {index} ({describe}) exited with status {code}{said}", retriable=code not in (EXIT_USAGE,)
    )


def watch(group: ActorGroup, *, poll_s: float, stop_requested: Callable[[], str | None]) -> Outcome:
    """Poll the group's actors until every rank finished, one failed, or the driver was asked to stop."""
    finished: set[int] = set()
    timeout = group.actor_timeout
    while True:
        signal_name = stop_requested()
        if signal_name:
            return Outcome(EXIT_INTERRUPTED, f"stopped by {signal_name}")
        try:
            for i, member in enumerate(group.ranks):
                if i in finished:
                    continue
                code = call(member, "poll", timeout=timeout, query=True)
                if code == 0:
                    finished.add(i)
                elif code is not None:
                    return _rank_exit(i, member.describe(), code, _note(member, timeout))
            if len(finished) == len(group.ranks):
                return Outcome(0)
            for member in group.servers:
                failure = call(member, "failure", timeout=timeout, query=True)
                if failure:
                    return Outcome(1, f"rollout server of {member.describe()} ended: {failure}", retriable=True)
        except ActorLost as exc:
            return Outcome(1, str(exc), retriable=True)
        time.sleep(poll_s)


def _note(member: Member, timeout: float) -> str:
    """The line rank ``member``'s process exited with (empty if it left none or the actor is gone)."""
    try:
        return str(call(member, "exit_note", timeout=timeout, query=True) or "")
    except ActorLost:
        return ""


def stop_ranks(group: ActorGroup, grace: float) -> dict[str, int | None]:
    """SIGTERM every rank still running (each finishes its step, saves a checkpoint where its peers
    still answer, and exits), SIGKILL after ``grace`` s; each reachable rank's exit status by name."""
    import ray

    refs = {m.name: m.handle.stop.remote(grace) for m in group.ranks}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=grace + group.actor_timeout)
    codes: dict[str, int | None] = {}
    for name, ref in refs.items():
        try:
            codes[name] = ray.get(ref, timeout=0)
        except Exception:  # dead or lost: nothing left to stop there
            codes[name] = None
    return codes
