"""Faults a run detects and reports as one clear message (no traceback).

Exit statuses of ``core-rl train`` (see :mod:`core_rl.cli`): :class:`RunFailed` and its subclasses
exit with 1, :class:`TrainingInterrupted` with 3; configuration errors stay at 2.
"""

from __future__ import annotations

from core_rl.errors import CoreRLError


class RunFailed(CoreRLError):
    """The run stopped on a fault it detected (a broken reward, a non-finite loss, a rank that
    stopped answering, a full disk). The message says what happened, where, and what to do."""

    exit_code = 1


class RewardError(RunFailed):
    """The reward failed in a way the configuration says ends the run, or returned a wrong
    number of scores."""


class NonFiniteError(RunFailed):
    """A step's loss or gradient norm was NaN/inf and ``trainer.on_nonfinite`` (or the limit on
    consecutive such steps) ends the run."""


class CollectiveTimeout(RunFailed):
    """A rank waited longer than ``trainer.collective_timeout_s`` for the others, or lost its
    connection to them."""


class PeerFailure(RunFailed):
    """Another rank failed; this rank stops with that rank's message and exit status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DiskFullError(RunFailed):
    """Writing a checkpoint (or another run file) found no space left on the device."""


class TrainingInterrupted(CoreRLError):
    """SIGINT or SIGTERM stopped the run after it saved a checkpoint; resume to continue."""

    exit_code = 3
