"""The trainer rank actor's process and exit note, as plain objects (no Ray needed: the class is
wrapped with ``ray.remote`` only by :mod:`core_rl_ray.group`): a real child process per rank, its
note an anonymous file the actor holds, closed once the rank has ended whether or not the driver
asks for the note, and nothing left on disk by an actor killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
from core_rl.reliability import exit_note
from core_rl.testing.processes import environment_of
from core_rl_ray.actors import TrainerRank
from core_rl_server_kit.processes import pid_alive

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
    note = rank.note_path()
    assert note.startswith(f"/proc/{os.getpid()}/fd/")  # named while it runs, as the actor's descriptor
    assert os.readlink(note).startswith("/memfd:core-rl-rank-note")
    assert _ended(rank) == 0
    assert list(notes_dir.iterdir()) == []
    assert rank.exit_note() == "" and rank.note_path() == ""
    assert not os.path.exists(note)  # the descriptor is closed


def test_a_failed_rank_keeps_its_note_for_the_driver_after_the_file_is_gone(notes_dir: Path) -> None:
    rank = TrainerRank()
    rank.start(["-c", NOTE_THEN_EXIT_4], {})
    assert _ended(rank) == 4
    assert list(notes_dir.iterdir()) == [] and rank.note_path() == ""
    assert rank.exit_note() == "diverged at step 3"
    assert rank.exit_note() == "diverged at step 3"  # asked again (the driver may)


def test_a_stopped_rank_leaves_no_note_file(notes_dir: Path) -> None:
    rank = TrainerRank()
    rank.start(["-c", "import time; time.sleep(60)"], {})
    assert rank.stop(grace=10) == -15  # SIGTERM ends a plain sleeping process
    assert list(notes_dir.iterdir()) == [] and rank.note_path() == ""


def test_the_note_of_a_running_rank_is_read_from_its_file(notes_dir: Path) -> None:
    rank = TrainerRank()
    rank.start(["-c", "import sys, time; sys.stdin.read(); time.sleep(60)"], {})
    note = Path(rank.note_path())
    note.write_text("still stepping\n")
    assert rank.exit_note() == "still stepping"
    rank.stop(grace=10)
    assert not note.exists()


def test_a_second_rank_of_the_actor_starts_with_an_empty_note(notes_dir: Path) -> None:
    rank = TrainerRank()
    rank.start(["-c", NOTE_THEN_EXIT_4], {})
    assert _ended(rank) == 4
    rank.start(["-c", "pass"], {})
    assert _ended(rank) == 0
    assert rank.exit_note() == ""


#: an actor's process: starts a rank that writes its note and sleeps, prints the rank's pid, then
#: waits to be killed
ACTOR = """
import time
from core_rl_ray.actors import TrainerRank
rank = TrainerRank()
body = "from core_rl.reliability import exit_note; exit_note.write('stepping'); import time; time.sleep(120)"
pid = rank.start(["-c", body], {})
while rank.exit_note() != "stepping":
    time.sleep(0.05)
print(pid, flush=True)
time.sleep(120)
"""


def test_an_actor_killed_outright_leaves_no_note_behind(tmp_path: Path) -> None:
    """A killed actor runs no cleanup; its rank's note must not outlive it (a file in the node's
    temporary directory for every killed rank, before the note was anonymous)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    actor = subprocess.Popen([sys.executable, "-c", ACTOR], env=env, stdout=subprocess.PIPE, text=True)
    try:
        rank_pid = int(actor.stdout.readline())
        note = environment_of(rank_pid)[exit_note.VARIABLE]
        assert Path(note).read_text() == "stepping\n"
        actor.send_signal(signal.SIGKILL)
        actor.wait(timeout=30)
        deadline = time.monotonic() + 30
        while pid_alive(rank_pid):  # the rank dies with its actor (its parent-death signal)
            assert time.monotonic() < deadline, "the rank outlived its killed actor"
            time.sleep(0.05)
    finally:
        actor.kill()
        actor.wait()
        actor.stdout.close()
    assert not Path(note).exists()
    assert list(tmp_path.iterdir()) == []
