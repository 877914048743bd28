"""The engine's user-facing errors (reported by the CLI as a message, exit status 2)."""

from __future__ import annotations

from core_rl.errors import CoreRLError


class MegatronSetupError(CoreRLError):
    """The model or the parallel layout cannot be built as configured; the message names the
    configuration key or model file and what to change."""
