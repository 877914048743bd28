"""Running a plugin's synchronous code under a deadline it cannot escape.

:func:`call_with_deadline` runs one call (a sample filter's ``filter``, a logger's ``log``) in a
fresh daemon thread and waits at most ``timeout_s`` for it, the wait registered with the progress
watchdog (:mod:`core_rl.reliability.progress`) as the call ``<words>: <doing>``. The call's result or exception comes
back unchanged; a call still running at its deadline raises :class:`DeadlinePassed`, whose message
is one line naming the plugin (its words from :mod:`core_rl.plugins.attribution`: kind, name,
distribution), the call, how long it waited and the config key that sets the bound.

Python cannot stop a thread: the call that ran past its deadline keeps its thread until it returns.
The thread is a daemon, so it never keeps the process from exiting. Light: no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from core_rl.errors import PluginFault
from core_rl.reliability.progress import PROGRESS

T = TypeVar("T")


class DeadlinePassed(PluginFault):
    """A plugin's call ran past its deadline and the run stops (exit status 1): the message is one
    line naming the plugin, its distribution, the call, the wait and the key that sets it."""


def deadline_message(words: str, doing: str, timeout_s: float, key: str) -> str:
    """``<words>: <doing> did not return within <t> s (<key>); ...``: what :class:`DeadlinePassed` says."""
    return (
        f"{words}: {doing} did not return within {timeout_s:g} s ({key}); the run stops, keeping its last "
        f"checkpoint. Fix the plugin's blocking call, or raise {key}"
    )


class _Outcome:
    """What the worker thread's call gave: its result or exception, and whether it returned."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


def call_with_deadline(
    words: str, doing: str, timeout_s: float, key: str, fn: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    """``fn(*args, **kwargs)`` run in a daemon thread and waited for at most ``timeout_s`` seconds
    (see the module docstring). Returns its result or raises its exception as it is; raises
    :class:`DeadlinePassed` (naming ``words``, ``doing`` and ``key``) when it has not returned by then."""
    outcome = _Outcome()
    label = f"{words}: {doing}"

    def work() -> None:
        try:
            outcome.result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome.error = exc
        finally:
            outcome.done.set()

    with PROGRESS.call(label):  # registered by the waiting thread: an abandoned call does not linger
        threading.Thread(target=work, name=f"deadline {doing}"[:60], daemon=True).start()
        returned = outcome.done.wait(timeout_s)
    if not returned:
        raise DeadlinePassed(deadline_message(words, doing, timeout_s, key))
    if outcome.error is not None:
        raise outcome.error
    return outcome.result
