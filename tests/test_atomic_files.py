"""core_rl.checkpoint.atomic: a directory replaced atomically (one renameat2 exchange, or two renames
where that is missing), a stale partial write removed, a file replaced whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from core_rl.checkpoint import atomic as atomic_files


def _write(final: Path, text: str) -> None:
    tmp = atomic_files.prepare_partial(final)
    (tmp / "data.txt").write_text(text)
    atomic_files.commit_partial(final)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_commit_creates_and_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    if not exchange:
        monkeypatch.setattr(atomic_files, "_exchange", lambda a, b: False)
    final = tmp_path / "out"
    _write(final, "one")
    (final / "only-in-old.txt").write_text("x")
    _write(final, "two")
    assert sorted(p.name for p in final.iterdir()) == ["data.txt"]
    assert (final / "data.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_prepare_removes_a_stale_partial(tmp_path: Path) -> None:
    final = tmp_path / "out"
    stale = atomic_files.partial_path(final)
    stale.mkdir()
    (stale / "junk").write_text("half written")
    tmp = atomic_files.prepare_partial(final)
    assert tmp == stale and list(tmp.iterdir()) == []
    assert not final.exists()  # nothing appears at the destination before commit
    atomic_files.discard_partial(final)
    assert not stale.exists()


def test_write_text_atomic_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "latest"
    atomic_files.write_text_atomic(path, "step_1")
    atomic_files.write_text_atomic(path, "step_2")
    assert path.read_text() == "step_2"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]
