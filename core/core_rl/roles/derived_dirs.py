"""Directories a run derives from a user's directory before anything loads it (a model with
``<role>.model_overrides``, a tokenizer with ``data.chat_template``): made once by rank 0 and
recognised again by a stamp naming what they were made from, so a resumed run or another rank
reuses them and a changed source makes them anew."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

#: the file naming what a derived directory was made from
STAMP = ".core_rl_source.json"
#: how long a rank waits for rank 0 to make a directory
WAIT_S = 300.0


def holds(target: Path, stamp: str) -> bool:
    """Whether ``target`` was made from what ``stamp`` names."""
    try:
        return (target / STAMP).read_text(encoding="utf-8") == stamp
    except OSError:
        return False


def made_once(target: Path, stamp: str, fill: Callable[[Path], None], *, rank: int, what: str) -> Path:
    """``target``, made by ``fill`` (given an empty partial directory) unless it already holds
    ``stamp``; the partial directory, stamped, is renamed into place (replacing a directory made
    from something else). Rank 0 makes it; another rank waits for it (at most :data:`WAIT_S`
    seconds; ``what`` names the setting in the timeout's message)."""
    if holds(target, stamp):
        return target
    if rank != 0:
        deadline = time.monotonic() + WAIT_S
        while not holds(target, stamp):
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {WAIT_S:.0f} s for rank 0 to make {target} ({what})")
            time.sleep(0.2)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(partial)
        (partial / STAMP).write_text(stamp, encoding="utf-8")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    return target
