"""A count of a recurring event of a run's steps (non-finite losses, empty steps), kept in checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class StreakCounter:
    """``total``: steps with the event so far; ``streak``: such steps in a row up to the last one
    counted. :meth:`count` records a step; the state goes into checkpoints."""

    def __init__(self) -> None:
        self.total = 0
        self.streak = 0

    def count(self, happened: bool) -> None:
        """Record one step, with the event or without."""
        if happened:
            self.total += 1
            self.streak += 1
        else:
            self.streak = 0

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "streak": self.streak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.total = int(state.get("total", 0))
        self.streak = int(state.get("streak", 0))
