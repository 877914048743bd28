"""Where a run keeps its checkpoints and which one it resumes from.

Layout: ``<run>/checkpoints/step_<N>/`` (written atomically by the train engine: a directory under
its final name is complete) plus ``latest``, naming the newest one, written atomically after it.

- :func:`find_resumable` picks the checkpoint ``latest`` names if it is valid, else the newest
  valid one by step, and says why it passed any over (``latest`` missing, naming a directory that
  is gone, or a checkpoint whose files are broken).
- :func:`prune` keeps the newest ``keep_last`` checkpoints up to the one ``latest`` names and never
  deletes that one; checkpoints of later steps than it are left alone (they are not part of this
  run's history: a resume that passed them over found them broken).
- :func:`is_disk_full` recognises "no space left on device" in an error or its causes, whichever
  library raised it.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Callable, Collection
from pathlib import Path

import attrs

from core_rl.checkpoint.files import CheckpointFormatError, write_text_atomic
from core_rl.errors import CoreRLError

LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^\.step_\d+\.(partial|old)$")


def checkpoints_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step in a checkpoint directory's name, or ``None`` if it is not named like one."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def mark_latest(run_dir: Path, step: int) -> None:
    write_text_atomic(checkpoints_root(run_dir) / LATEST, checkpoint_dir(run_dir, step).name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint directory ``latest`` names, if it exists (not checked further)."""
    pointer = checkpoints_root(run_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoints_root(run_dir) / pointer.read_text(encoding="utf-8").strip()
    return path if step_of(path) is not None and path.is_dir() else None


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every directory named like a checkpoint, by step."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


@attrs.define
class Resumable:
    """The checkpoint to resume from (``None``: there is none) and what was passed over, and why."""

    path: Path | None
    step: int
    notes: list[str] = attrs.field(factory=list)


def find_resumable(run_dir: Path, check: Callable[[Path], None]) -> Resumable:
    """The checkpoint ``latest`` names if ``check`` accepts it, else the newest by step that it
    accepts. ``check`` raises :class:`CheckpointFormatError` (or ``OSError``) for a bad one."""
    root = checkpoints_root(run_dir)
    pointer = root / LATEST
    notes: list[str] = []
    named: Path | None = None
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        named = root / name
        if step_of(named) is None or named.parent != root:
            notes.append(f"{pointer} names {name!r}, which is not a checkpoint directory")
            named = None
        elif not named.is_dir():
            notes.append(f"{pointer} names {name}, which does not exist")
            named = None
        else:
            try:
                check(named)
                return Resumable(named, step_of(named) or 0)
            except (CheckpointFormatError, OSError) as exc:
                notes.append(f"{pointer} names {name}, which is not a valid checkpoint: {exc}")
    elif list_checkpoints(run_dir):
        notes.append(f"{pointer} is missing")
    for step, path in reversed(list_checkpoints(run_dir)):
        if path == named:
            continue
        try:
            check(path)
        except (CheckpointFormatError, OSError) as exc:
            notes.append(f"{path.name} is not a valid checkpoint, skipped: {exc}")
            continue
        notes.append(f"resuming from {path.name}, the newest valid checkpoint")
        return Resumable(path, step, notes)
    return Resumable(None, 0, notes)


def roll_back(run_dir: Path, step: int) -> tuple[Path | None, list[Path]]:
    """Make the checkpoint of ``step`` the run's newest, so that resuming continues from it.

    Nothing is deleted: the checkpoints of later steps move into ``checkpoints/rolled_back_from_<M>``
    (``M``: the newest of them), with a copy of the run's ``metrics.jsonl`` and ``samples.jsonl``
    as they were (resuming truncates those to ``step``), and ``latest`` then names ``step``.
    Returns that directory (``None`` when no later checkpoint existed) and the moved checkpoints.
    Raises :class:`~core_rl.errors.CoreRLError` when ``step`` has no checkpoint directory, listing
    the steps that have one."""
    target = checkpoint_dir(run_dir, step)
    found = list_checkpoints(run_dir)
    if not target.is_dir():
        steps = ", ".join(str(s) for s, _ in found) or "none"
        raise CoreRLError(f"{run_dir}: no checkpoint of step {step} ({target}); checkpoints of steps: {steps}")
    later = [p for s, p in found if s > step]
    aside: Path | None = None
    if later:
        aside = checkpoints_root(run_dir) / f"rolled_back_from_{step_of(later[-1])}"
        if aside.exists():
            raise CoreRLError(f"{aside} exists already: move it away first (it holds an earlier roll-back)")
        aside.mkdir()
        for name in ("metrics.jsonl", "samples.jsonl"):
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, aside / name)
        for path in later:
            path.rename(aside / path.name)
    mark_latest(run_dir, step)
    return aside, later


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Delete the ``.step_N.partial`` / ``.step_N.old`` directories of interrupted saves."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    removed = [p for p in root.iterdir() if _LEFTOVER.match(p.name)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune(run_dir: Path, keep_last: int, keep: Callable[[list[int]], Collection[int]] | None = None) -> list[Path]:
    """Keep the newest ``keep_last`` checkpoints up to the one ``latest`` names (always kept) and
    those ``keep`` chooses from the steps of the older ones (``saver.keep_best``); delete the rest
    and leftovers of interrupted saves. Does nothing while ``latest`` names no existing checkpoint."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return []
    newest = step_of(latest)
    assert newest is not None
    older = [(s, p) for s, p in list_checkpoints(run_dir) if s < newest]
    kept = set(keep([s for s, _ in older])) if keep is not None else set()
    outside = [p for s, p in older if s not in kept]
    doomed = outside[: max(0, len(outside) - (max(keep_last, 1) - 1))]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed + remove_leftovers(run_dir)


_DISK_FULL_TEXT = ("no space left on device", "storagefull", "disk quota exceeded", "os error 28")


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` or an error it was raised from says the device is full (``ENOSPC`` /
    ``EDQUOT``, also as text: safetensors and other native code report it as a message)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(marker in str(current).lower() for marker in _DISK_FULL_TEXT):
            return True
        current = current.__cause__ or current.__context__
    return False
