"""Atomic directories and RNG snapshots for checkpoints and exports.

A directory is written under a temporary name next to its destination (``.NAME.partial``) and only
then moved into place, so ``NAME`` is either absent, the previous complete version, or the new
complete version, never half written. Replacing an existing ``NAME`` uses Linux's
``renameat2(RENAME_EXCHANGE)`` (one atomic swap) where the file system supports it; elsewhere the
old directory is first renamed to ``.NAME.old`` and then the new one into place (a crash between
the two renames leaves the complete old version at ``.NAME.old``).
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def partial_path(final: Path) -> Path:
    """Where ``final`` is written before it is moved into place."""
    return final.parent / f".{final.name}.partial"


def prepare_partial(final: Path) -> Path:
    """Create an empty ``partial_path(final)`` (removing a stale one from an interrupted write)."""
    tmp = partial_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the directories themselves to disk."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not support fsync on directories
        pass
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap ``a`` and ``b`` (both exist); False if the platform cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def commit_partial(final: Path) -> None:
    """Move the finished ``partial_path(final)`` to ``final``, replacing a previous ``final``."""
    tmp = partial_path(final)
    _fsync_tree(tmp)
    if final.exists():
        if _exchange(tmp, final):
            shutil.rmtree(tmp)  # now the old version
        else:
            old = final.parent / f".{final.name}.old"
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def capture_rng() -> dict[str, Any]:
    """The RNG states of Python, NumPy (if installed), torch CPU and every CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` returned (CUDA only if it was captured and is present)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            warnings.warn("checkpoint holds CUDA RNG states for a different set of devices; not restored", stacklevel=2)
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:
            pass
