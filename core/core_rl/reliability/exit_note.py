"""The one line a trainer rank's process leaves for the launcher that started it, saying why it
exited: a launcher that does not read the rank's output itself (the Ray launcher's driver, whose
ranks write to their actors' logs) sets ``CORE_RL_EXIT_NOTE`` to a file path in the rank's
environment; ``core-rl train`` writes the message it ends with there (:func:`write`), and the
launcher reads it back (:func:`read`) to name the reason in its own message. Without the variable
nothing is written."""

from __future__ import annotations

import os
from pathlib import Path

#: the environment variable naming the file
VARIABLE = "CORE_RL_EXIT_NOTE"


def path_of(rank: int | str, template: str) -> Path:
    """The note file of ``rank`` for a ``CORE_RL_EXIT_NOTE`` value (``{rank}`` in it is replaced
    by the rank: one value for every rank of a launch)."""
    return Path(template.replace("{rank}", str(rank)))


def write(message: str) -> None:
    """Write the first line of ``message`` to the file ``CORE_RL_EXIT_NOTE`` names (if set;
    :func:`path_of` with this process's ``RANK``); never raises (a rank that is stopping must not
    fail here)."""
    template = os.environ.get(VARIABLE)
    if not template:
        return
    path = path_of(os.environ.get("RANK", "0"), template)
    line = (message.strip().splitlines() or [""])[0]
    try:
        Path(path).write_text(line + "\n", encoding="utf-8")
    except OSError:
        pass


def read(path: str | Path) -> str:
    """The note at ``path`` (empty when there is none)."""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError:
        return ""
