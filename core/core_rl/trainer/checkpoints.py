"""Where a run keeps its checkpoints: ``<run>/checkpoints/step_<N>/`` plus a ``latest`` file naming
the newest complete one (written atomically after the checkpoint itself), pruned to ``keep_last``."""

from __future__ import annotations

import shutil
from pathlib import Path

from core_rl.checkpointing import write_text_atomic

LATEST = "latest"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def mark_latest(run_dir: Path, step: int) -> None:
    write_text_atomic(run_dir / "checkpoints" / LATEST, checkpoint_dir(run_dir, step).name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or ``None``."""
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text(encoding="utf-8").strip()
    return path if path.is_dir() else None


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (never the one ``latest`` names)."""
    root = run_dir / "checkpoints"
    keep = latest_checkpoint(run_dir)
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    removed = []
    for path in steps[:-keep_last] if keep_last > 0 else []:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
