"""The testing kit's pytest plugin (``core_rl.testing.pytest_plugin``, entry point ``pytest11``):
a third-party plugin's test run, with no marker declared in its own configuration, knows the
markers the kit's contract classes carry (``server_env``, ``gpu``, ``slow``), even under
``--strict-markers``; a marker nobody registers still fails there (the check is real)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TEST_FILE = """
import pytest

@pytest.mark.server_env("vllm")
@pytest.mark.gpu
@pytest.mark.slow
def test_marked():
    assert True
"""


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # a project of its own: not this repository's markers
    (tmp_path / "test_third_party.py").write_text(body)
    command = [sys.executable, "-m", "pytest", "-q", "--strict-markers", "-p", "no:cacheprovider", str(tmp_path)]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)


def test_the_kits_markers_are_known_to_a_third_party_test_run(tmp_path: Path) -> None:
    proc = _run(tmp_path, TEST_FILE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout and "PytestUnknownMarkWarning" not in proc.stdout


def test_an_unregistered_marker_still_fails_under_strict_markers(tmp_path: Path) -> None:
    proc = _run(tmp_path, TEST_FILE.replace("@pytest.mark.slow", "@pytest.mark.no_such_marker_core_rl"))
    assert proc.returncode != 0 and "no_such_marker_core_rl" in proc.stdout + proc.stderr
