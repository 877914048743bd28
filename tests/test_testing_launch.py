"""The testing kit's torchrun helpers leave no log folder of torch's elastic agent behind: the agent
logs into a folder the helper makes, and the helper removes it when the run ends (left to itself the
agent makes a ``torchelastic_*`` folder in the system's temporary directory at every launch)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from core_rl.testing.launch import run_torchrun, train_command

#: a rank that writes where the agent told it to leave its error file (inside the agent's log folder)
WORKER = """import os, sys
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as out:
    out.write(os.environ["TORCHELASTIC_ERROR_FILE"])
"""


def test_run_torchrun_logs_into_a_folder_it_removes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir()
    out.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the helper makes its folder
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run_torchrun(script, 2, str(out), timeout=180)
    for rank in range(2):
        error_file = Path((out / f"rank{rank}").read_text())
        assert error_file.is_relative_to(scratch), error_file
        assert error_file.relative_to(scratch).parts[0].startswith("core-rl-torchrun-")
    assert list(scratch.iterdir()) == []  # removed with everything the agent wrote into it


def test_train_command_names_the_log_folder_only_under_torchrun(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    assert f"--log-dir={tmp_path}" in train_command(config, nproc=2, log_dir=tmp_path)
    assert not any(arg.startswith("--log-dir") for arg in train_command(config, log_dir=tmp_path))
    assert not any(arg.startswith("--log-dir") for arg in train_command(config, nproc=2))
