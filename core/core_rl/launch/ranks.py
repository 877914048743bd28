"""Waiting on other ranks, always bounded, and telling them about failures.

Under ``torchrun`` every rank runs the loop; rank 0 alone builds the rollout engine, reward and
loggers and runs rollouts and rewards. Every wait on another rank is a collective of the default
process group, whose timeout is ``trainer.collective_timeout_s``: :func:`set_collective_timeout` is
called before the train engine is built (an engine that creates the group passes
:func:`collective_timeout` to ``init_process_group``) and applies it to a group that already exists.

:func:`waiting_for` names what a collective waits for, so a timeout (a stopped, hung or dead rank)
becomes a :class:`~core_rl.loops.errors.CollectiveTimeout` that says so, and the progress
watchdog (:mod:`core_rl.reliability.watchdog`) names it for a rank blocked in one; the agreement points
are the ``collective`` phase of a step (:mod:`core_rl.reliability.progress`). A failure on one rank is
shared with the others at the next agreement point (:func:`broadcast_outcome`,
:func:`agree_after`), so every rank stops with the failing rank's message instead of waiting.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from core_rl.errors import CoreRLError
from core_rl.loops.errors import CollectiveTimeout, PeerFailure
from core_rl.reliability.progress import PROGRESS

_TIMEOUT_MARKERS = ("timed out", "timeout", "deadline exceeded")
_LOST_MARKERS = ("connection closed", "connection reset", "broken pipe", "connection refused", "socket closed")

_collective_timeout: datetime.timedelta | None = None


def collective_timeout() -> datetime.timedelta | None:
    """The timeout a process group created now should get (``None``: the backend's default)."""
    return _collective_timeout


def set_collective_timeout(seconds: float) -> None:
    """Use ``seconds`` for process groups created from now on, and for the default group if it
    exists already (gloo and NCCL backends both accept a new timeout)."""
    global _collective_timeout
    _collective_timeout = datetime.timedelta(seconds=seconds)
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    group = dist.group.WORLD
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        try:
            backend = group._get_backend(device)
        except RuntimeError:  # no backend for this device type
            continue
        setter = getattr(backend, "set_timeout", None) or getattr(backend, "_set_default_timeout", None)
        if setter is not None:
            setter(_collective_timeout)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a name or an address; ``None``: no master, a single process) is this
    machine's loopback."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def listen_on_loopback_unless_configured(master_addr: str | None) -> None:
    """Point gloo and NCCL at the loopback interface when every rank is on this machine and the
    user chose no interface, so their sockets do not listen on the network."""
    if not is_loopback(master_addr):
        return
    lo = loopback_interface()
    if lo is None:
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, lo)


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _seconds() -> str:
    return f"{_collective_timeout.total_seconds():g} s" if _collective_timeout else "the process-group timeout"


@contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """Run collectives that wait for ``what``; a timeout or a lost connection to another rank
    becomes a :class:`CollectiveTimeout` naming ``what`` (the original error is chained)."""
    try:
        with PROGRESS.waiting(what):
            yield
    except RuntimeError as exc:  # torch.distributed.DistBackendError is a RuntimeError
        text = str(exc).lower()
        rank = rank_and_world()[0]
        if any(m in text for m in _TIMEOUT_MARKERS):
            raise CollectiveTimeout(
                f"rank {rank}: waited more than {_seconds()} for {what}; another rank is stopped, hung or "
                f"dead (trainer.collective_timeout_s sets the limit). Underlying error: {_first_line(exc)}"
            ) from exc
        if any(m in text for m in _LOST_MARKERS):
            raise CollectiveTimeout(
                f"rank {rank}: lost the connection to another rank while waiting for {what}; that rank "
                f"probably failed (see its output). Underlying error: {_first_line(exc)}"
            ) from exc
        raise


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


@attrs.define
class Outcome:
    """What one rank reports at an agreement point: its failure (message and exit status, or
    ``None``) and a stop signal it received (its name, or ``None``)."""

    rank: int
    error: str | None = None
    exit_code: int = 1
    stop: str | None = None


def describe_failure(exc: BaseException) -> tuple[str, int]:
    """The message and exit status another rank reports for ``exc``."""
    if isinstance(exc, CoreRLError):
        return str(exc), exc.exit_code
    return f"{type(exc).__name__}: {exc} (the traceback is in that rank's output)", 1


def outcome_of(rank: int, exc: BaseException | None, stop: str | None = None) -> Outcome:
    if exc is None:
        return Outcome(rank=rank, stop=stop)
    message, code = describe_failure(exc)
    return Outcome(rank=rank, error=message, exit_code=code, stop=stop)


def raise_first_failure(outcomes: list[Outcome], own: BaseException | None) -> None:
    """Re-raise this rank's own failure, or raise the first other rank's as a :class:`PeerFailure`."""
    if own is not None:
        raise own
    for outcome in outcomes:
        if outcome.error is not None:
            raise PeerFailure(f"rank {outcome.rank} failed: {outcome.error}", outcome.exit_code)


def agree_after(what: str, error: BaseException | None, stop: str | None = None) -> str | None:
    """Every rank calls this after ``what``, each with its own failure (or ``None``) and stop
    signal. Raises on every rank if any failed (see :func:`raise_first_failure`); otherwise returns
    the first stop signal any rank received (``None`` if none). Without a group it only re-raises."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    if world == 1:
        if error is not None:
            raise error
        return stop
    gathered: list[Any] = [None] * world
    waited = f"the other ranks to finish {what}"
    with PROGRESS.phase("collective", waited), waiting_for(waited):
        dist.all_gather_object(gathered, attrs.asdict(outcome_of(rank, error, stop)))
    outcomes = [Outcome(**o) for o in gathered]
    raise_first_failure(outcomes, error)
    return next((o.stop for o in outcomes if o.stop), None)


def broadcast_outcome(what: str, value: Any, error: BaseException | None) -> Any:
    """Rank 0 sends ``value`` (or its failure) to every rank; the others return ``value`` or raise
    rank 0's failure. ``what`` names what is sent, e.g. "the batch of step 3"."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    if world == 1:
        if error is not None:
            raise error
        return value
    box = [(value, attrs.asdict(outcome_of(0, error))) if rank == 0 else None]
    waited = f"the other ranks to receive {what}" if rank == 0 else f"rank 0 to send {what}"
    with PROGRESS.phase("collective", waited), waiting_for(waited):
        dist.broadcast_object_list(box, src=0)
    sent, outcome = box[0]
    raise_first_failure([Outcome(**outcome)], error if rank == 0 else None)
    return sent
