"""Atomic files and directories (no torch: loggers and the run's records use these too).

A directory ``NAME`` is written under ``.NAME.partial`` next to it and moved into place only when
complete, so ``NAME`` is absent, the previous complete version, or the new complete version, never
half written. Replacing an existing ``NAME`` uses Linux's ``renameat2(RENAME_EXCHANGE)`` (one atomic
swap) where the file system supports it; elsewhere the old directory is renamed to ``.NAME.old``
first (a crash between the two renames leaves the complete old version there). A single file is
written to a temporary name, flushed to disk and renamed over the old one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

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


def discard_partial(final: Path) -> None:
    """Remove ``partial_path(final)`` and whatever was written into it."""
    shutil.rmtree(partial_path(final), ignore_errors=True)


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


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """The temporary path ``.NAME.tmp`` beside ``path`` for the body to write ``path``'s content
    to; when the body ends without an error the file is flushed to disk and renamed to ``path``
    (atomically replacing an older one), else removed: ``path`` is never half written."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file, fsync and an atomic rename."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
