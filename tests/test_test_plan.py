"""``scripts/test.sh`` builds and installs only what the selected tests need: a selection without
server or Slurm tests starts no server-environment build and no apt-get; one with a server test
starts that environment's build. ``CORE_RL_TEST_PLAN_ONLY=1`` prints the plan and stops.

The script runs here against a stand-in for the virtual environment whose ``core-rl`` and
``ruff`` only record their arguments, and an ``apt-get`` on ``PATH`` that does likewise, so
nothing is built or installed for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER_TESTS = "plugins/engines/vllm/tests/test_server_failures.py"  # marked server_env("vllm")
SLURM_TESTS = "plugins/launchers/slurm/tests/test_local_slurm.py"  # marked after_setup("slurm-packages")
PLAIN_TESTS = "tests/test_atomic_files.py"


@pytest.fixture
def stand_in(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``scripts/test.sh`` run whose ``$VENV`` holds this interpreter and
    recording ``core-rl`` and ``ruff``, with a recording ``apt-get`` first on ``PATH``; the calls
    go to ``calls.log``."""
    calls = tmp_path / "calls.log"
    venv_bin = tmp_path / "venv" / "bin"
    tools = tmp_path / "tools"
    for folder in (venv_bin, tools):
        folder.mkdir(parents=True)
    (venv_bin / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for name, folder in (("core-rl", venv_bin), ("ruff", venv_bin), ("apt-get", tools)):
        (folder / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
    for script in [*venv_bin.iterdir(), *tools.iterdir()]:
        script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORE_RL_") and k != "PYTEST_ADDOPTS"}
    env |= {
        "VENV": str(tmp_path / "venv"),
        "CORE_RL_TEST_INSTALL": "0",
        "CORE_RL_TEST_WORKERS": "0",
        "PATH": f"{tools}:{env['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    return env


def _run(env: dict[str, str], *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/test.sh", *args],
        cwd=ROOT,
        env=env | extra,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _calls(env: dict[str, str]) -> list[str]:
    log = Path(env["VENV"]).parent / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_a_selection_without_server_or_slurm_tests_builds_and_installs_nothing(stand_in):
    proc = _run(stand_in, PLAIN_TESTS, "-p", "no:cacheprovider")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _calls(stand_in) == ["ruff check .", "ruff format --check ."]


def test_a_server_test_in_the_selection_builds_its_environment(stand_in):
    proc = _run(stand_in, SERVER_TESTS, "--collect-only", "-p", "no:cacheprovider")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _calls(stand_in) == ["ruff check .", "ruff format --check .", "core-rl server-env create vllm"]
    assert "the vllm server environment: status 0" in proc.stdout


def test_deselected_server_tests_build_nothing(stand_in):
    proc = _run(stand_in, SERVER_TESTS, "-m", "not server_env", "--collect-only", "-p", "no:cacheprovider")
    assert proc.returncode == 5, proc.stdout + proc.stderr  # pytest: no test selected
    assert "core-rl server-env create vllm" not in _calls(stand_in)


def test_the_plan_names_each_step_and_its_opt_out(stand_in):
    proc = _run(stand_in, PLAIN_TESTS, CORE_RL_TEST_PLAN_ONLY="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == ["  nothing to build or install besides " + stand_in["VENV"]]
    proc = _run(stand_in, SERVER_TESTS, SLURM_TESTS, CORE_RL_TEST_PLAN_ONLY="1", CORE_RL_SLURM_TEST="0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:] == [
        "  after-setup slurm-packages: Slurm's packages: not installed (CORE_RL_SLURM_TEST=0)",
        "  server-env vllm: build the vllm server environment (core-rl server-env create vllm, ~2.5 GB under "
        "~/.cache/core-rl; instant when built)",
    ]
    assert _calls(stand_in) == []  # planning builds, installs and lints nothing


@pytest.mark.skipif(os.geteuid() != 0, reason="the script installs Slurm's packages only as root")
def test_slurm_packages_are_installed_only_for_a_selection_that_holds_the_slurm_test(stand_in):
    if any((Path(p) / "slurmctld").exists() for p in stand_in["PATH"].split(":")):
        pytest.skip("Slurm is installed here: the script has nothing to install")
    proc = _run(stand_in, SLURM_TESTS, "--collect-only", "-p", "no:cacheprovider")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [c for c in _calls(stand_in) if c.startswith("apt-get")] == [
        "apt-get update -q",
        "apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge",
    ]
    proc = _run(stand_in, SLURM_TESTS, "--collect-only", "-p", "no:cacheprovider", CORE_RL_SLURM_TEST="0")
    assert proc.returncode == 0 and len([c for c in _calls(stand_in) if c.startswith("apt-get")]) == 2
