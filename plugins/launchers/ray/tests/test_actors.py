"""The trainer rank actor's process and exit note, as plain objects (no Ray needed: the class is
wrapped with ``ray.remote`` only by :mod:`core_rl_ray.group`): a real child process per rank, and the
note file it leaves removed once the rank has ended, whether or not the driver asks for the note."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
from core_rl_ray.actors import TrainerRank

#: a rank's process that leaves the note "diverged at step 3" and exits 4
NOTE_THEN_EXIT_4 = (
    "from core_rl.reliability import exit_note; exit_note.write('diverged at step 3\\nmore'); raise SystemExit(4)"
)


@pytest.fixture
def notes_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _ended(rank: TrainerRank, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while (code := rank.poll()) is None:
        assert time.monotonic() < deadline, "the rank's process did not end"
        time.sleep(0.05)
    return code


def test_a_rank_that_succeeds_leaves_no_note_file(notes_dir: Path) -> None:
    rank = TrainerRank()
    rank.start(["-c", "pass"], {})
    assert len(list(notes_dir.glob("core-rl-rank-*.note"))) == 1  # named while it runs
    assert _ended(rank) == 0
    assert list(notes_dir.iterdir()) == []
    assert rank.exit_note() == ""


def test_a_failed_rank_keeps_its_note_for_the_driver_after_the_file_is_gone(notes_dir: Path) -> None:
    rank = TrainerRank()
    rank.start(["-c", NOTE_THEN_EXIT_4], {})
    assert _ended(rank) == 4
    assert list(notes_dir.iterdir()) == []
    assert rank.exit_note() == "diverged at step 3"
    assert rank.exit_note() == "diverged at step 3"  # asked again (the driver may)


def test_a_stopped_rank_leaves_no_note_file(notes_dir: Path) -> None:
    rank = TrainerRank()
    rank.start(["-c", "import time; time.sleep(60)"], {})
    assert rank.stop(grace=10) == -15  # SIGTERM ends a plain sleeping process
    assert list(notes_dir.iterdir()) == []


def test_the_note_of_a_running_rank_is_read_from_its_file(notes_dir: Path) -> None:
    rank = TrainerRank()
    rank.start(["-c", "import sys, time; sys.stdin.read(); time.sleep(60)"], {})
    (note,) = notes_dir.glob("core-rl-rank-*.note")
    note.write_text("still stepping\n")
    assert rank.exit_note() == "still stepping"
    rank.stop(grace=10)
    assert not note.exists()
