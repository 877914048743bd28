"""``scripts/gpu_check.sh`` and ``scripts/junit_summary.py`` on a machine without a GPU: the check refuses
loudly (a GPU check that skipped every GPU test would prove nothing), and the JUnit summary gives the
files a suite cut short by a machine's time limit can leave out when it goes on (those whose
collected tests all ran and passed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_one"/>
<testcase classname="tests.test_a" name="test_two"><skipped message="needs a GPU"/></testcase>
<testcase classname="plugins.engines.fsdp.tests.test_gpu.TestLayout" name="test_x"/>
<testcase classname="tests.test_b" name="test_one"/>
<testcase classname="tests.test_b" name="test_two"><failure message="boom">assert 0</failure></testcase>
<testcase classname="plugins.rewards.math.tests.test_extract" name="test_y"><error message="setup">x</error></testcase>
<testcase classname="" name="tests.test_c"><error message="collection failure">ImportError</error></testcase>
<testcase time="0.000"/>
<testcase classname="" name="plugins.x.tests.test_z"><skipped message="collection skipped"
 >('/r/conftest.py', 190, "Skipped: the core-rl-x distribution is not installed here")</skipped></testcase>
</testsuite></testsuites>
"""


CUT_SHORT = '<testcase classname="tests.test_d" name="test_one"/>\n'
COLLECTED = """tests/test_a.py::test_one
tests/test_a.py::test_two
plugins/engines/fsdp/tests/test_gpu.py::TestLayout::test_x
tests/test_b.py::test_one
tests/test_b.py::test_two
plugins/rewards/math/tests/test_extract.py::test_y
tests/test_d.py::test_one
tests/test_d.py::test_two[a]
"""


def test_the_suite_writes_what_it_collected(tmp_path: Path) -> None:
    """``CORE_RL_COLLECTED=FILE``: the node ids the session collected (here this file's tests)."""
    target = tmp_path / "collected.txt"
    env = {**os.environ, "CORE_RL_COLLECTED": str(target)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", __file__]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [line.split("::")[-1] for line in target.read_text().splitlines()]
    assert names == [
        "test_the_suite_writes_what_it_collected",
        "test_passed_files_are_those_whose_collected_tests_all_passed",
        "test_a_suite_stopped_by_its_deadline_is_reported_as_stopped_not_as_an_error",
        "test_the_suite_goes_on_from_several_earlier_runs_and_says_how_after_its_deadline",
        "test_the_gpu_check_refuses_without_cuda",
        "test_the_sources_digest_follows_the_wheels_sources_not_ignored_files",
        "test_a_nested_repository_counts_with_its_files",
    ]
    assert all(line.startswith("tests/test_gpu_check.py::") for line in target.read_text().splitlines())


def test_passed_files_are_those_whose_collected_tests_all_passed(tmp_path: Path) -> None:
    for name in ("tests/test_a.py", "tests/test_b.py", "plugins/engines/fsdp/tests/test_gpu.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "plugins/rewards/math/tests").mkdir(parents=True)
    (tmp_path / "plugins/rewards/math/tests/test_extract.py").write_text("")
    (tmp_path / "tests/test_d.py").write_text("")
    (tmp_path / "suite.xml").write_text(JUNIT)
    script = ROOT / "scripts" / "junit_summary.py"
    command = [sys.executable, str(script), "--passed-files", "suite.xml"]
    missing = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 2 and "collected.txt is missing" in missing.stderr
    # test_d's run was stopped after its first test: it collected two, the JUnit file holds one
    (tmp_path / "suite.xml").write_text(JUNIT.replace("</testsuite>", CUT_SHORT + "</testsuite>"))
    (tmp_path / "collected.txt").write_text(COLLECTED)
    (tmp_path / "broken.xml").write_text("<testsuites><testcase")  # killed while writing it
    broken = subprocess.run([*command[:-1], "broken.xml"], capture_output=True, text=True, cwd=tmp_path)
    assert broken.returncode == 2 and "broken.xml" in broken.stderr and "Traceback" not in broken.stderr
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["plugins/engines/fsdp/tests/test_gpu.py", "tests/test_a.py"]
    summary = subprocess.run([sys.executable, str(script), "suite.xml"], capture_output=True, text=True, cwd=tmp_path)
    assert summary.returncode == 1 and "4 passed, 1 failed, 2 error, 2 skipped" in summary.stdout
    assert "collection skipped: the core-rl-x distribution is not installed here" in summary.stdout


INTERRUPTED = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_one"/>
<testcase classname="tests.test_a" name="test_two"><skipped message="needs a GPU"/></testcase>
<testcase classname="pytest" name="internal"><error message="internal error">Traceback (most recent call last):
  gotit = waiter.acquire(True, timeout)
KeyboardInterrupt
RuntimeError: release unlocked lock</error></testcase>
</testsuite></testsuites>
"""


def test_a_suite_stopped_by_its_deadline_is_reported_as_stopped_not_as_an_error(tmp_path: Path) -> None:
    """A deadline's SIGINT leaves a nameless ``testcase`` for each test it cut off or, when it races
    pytest-xdist's shutdown, pytest's ``pytest::internal`` error ending in ``KeyboardInterrupt``:
    either way the summary says the run stopped and how many collected tests have no result, counts
    no test error for it, and exits 1 (an unfinished suite has not passed). Any other internal error
    is an error; a finished run of passing tests exits 0."""
    script = ROOT / "scripts" / "junit_summary.py"
    (tmp_path / "collected.txt").write_text(COLLECTED)

    def summary(xml: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / "suite.xml").write_text(xml)
        return subprocess.run([sys.executable, str(script), "suite.xml"], capture_output=True, text=True, cwd=tmp_path)

    cut_off = INTERRUPTED.replace(
        INTERRUPTED[INTERRUPTED.index('<testcase classname="pytest"') : INTERRUPTED.index("</testsuite>")],
        '<testcase time="0.000"/>\n<testcase time="0.000"/>\n',
    )
    for xml in (INTERRUPTED, cut_off):
        proc = summary(xml)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].split() == ["1", "passed,", "1", "skipped"]
        assert "stopped before the end" in lines[1] and "6 of the 8 collected tests have no result" in lines[1]
        assert "ERROR" not in proc.stdout
    other = summary(INTERRUPTED.replace("KeyboardInterrupt\n", "OSError: disk full\n"))
    assert other.returncode == 1 and "1 error" in other.stdout and "ERROR pytest::internal" in other.stdout
    assert "stopped" not in other.stdout
    finished = summary(cut_off.replace('<testcase time="0.000"/>\n', ""))
    assert finished.returncode == 0 and "stopped" not in finished.stdout, finished.stdout


STAND_IN = """#!/usr/bin/env bash
# an interpreter that says CUDA is there, records pytest's arguments and outlives the deadline
case "$*" in
  *torch.cuda.is_available*) exit 0 ;;
  *get_device_properties*) echo "gpu_check: 1 x stand-in GPU"; exit 0 ;;
  "-m pytest"*) echo "$@" > "$PYTEST_ARGS"; trap 'exit 2' INT; sleep 60 & wait; exit 2 ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


def test_the_suite_goes_on_from_several_earlier_runs_and_says_how_after_its_deadline(tmp_path: Path) -> None:
    """``SUITE_SKIP_PASSED`` takes the JUnit files of several earlier runs (space-separated) and
    leaves out the files that passed in any; a suite stopped by ``SUITE_TIMEOUT`` prints the command
    that goes on, with every earlier run, this one, the deadline and the part (``SUITE_PATHS``).
    CUDA is the stand-in interpreter's word here (the real check ran on a GPU machine)."""
    runs = {"run1": "tests/test_gpu_check.py", "run2": "tests/test_state_items.py"}
    for run, file in runs.items():
        (tmp_path / run).mkdir()
        module = file.removesuffix(".py").replace("/", ".")
        (tmp_path / run / "suite.xml").write_text(
            f'<testsuites><testsuite><testcase classname="{module}" name="test_one"/></testsuite></testsuites>'
        )
        (tmp_path / run / "collected.txt").write_text(f"{file}::test_one\n")
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    earlier = f"{tmp_path / 'run1' / 'suite.xml'} {tmp_path / 'run2' / 'suite.xml'}"
    env = {
        **os.environ,
        "PYTHON": str(stand_in),
        "REAL_PYTHON": sys.executable,
        "PYTEST_ARGS": str(tmp_path / "args.txt"),
        "OUT": str(tmp_path / "run3"),
        "SUITE_SKIP_PASSED": earlier,
        "SUITE_TIMEOUT": "2",
        "SUITE_PATHS": "tests plugins/engines",
        "WORKERS": "1",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "suite"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    args = (tmp_path / "args.txt").read_text().split()
    ignored = [args[i + 1] for i, arg in enumerate(args) if arg == "--ignore"]
    assert ignored == list(runs.values()) and args[-2:] == ["tests", "plugins/engines"], args
    assert "== suite: leaving out 2 files that passed in" in proc.stdout
    assert "== suite: exit 124" in proc.stdout
    hint = next(line for line in proc.stdout.splitlines() if line.startswith("== suite: stopped at SUITE_TIMEOUT=2 s"))
    assert f'SUITE_SKIP_PASSED="{earlier} {tmp_path / "run3" / "suite.xml"}"' in hint
    assert 'SUITE_TIMEOUT=2 SUITE_PATHS="tests plugins/engines" bash scripts/gpu_check.sh suite' in hint


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_gpu_check_refuses_without_cuda(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "gpu"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


def _digest(root: Path) -> str:
    script = ROOT / "scripts" / "offline" / "sources_digest.py"
    return subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, check=True).stdout


def test_the_sources_digest_follows_the_wheels_sources_not_ignored_files(tmp_path: Path) -> None:
    """What ``install.sh`` compares a wheelhouse with: the same for a checkout, the checkout with files
    git ignores (as the wheels leave them out), and a copy of it without ``.git`` (as a machine
    receives a working tree); different once a source changes."""
    import shutil

    repo = tmp_path / "repo"
    files = {
        "pyproject.toml": "[project]\nname = 'x'\n",
        "core/core_rl/a.py": "A = 1\n",
        "plugins/kind/p/pyproject.toml": "[project]\nname = 'p'\n",
        "plugins/kind/p/src/p/b.py": "B = 2\n",
        "plugins/kind/p/tests/test_b.py": "",  # not a wheel's source
        ".gitignore": "*.egg-info/\n*.swp\n__pycache__/\n",
    }
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    clean = _digest(repo)
    (repo / "core/core_rl.egg-info").mkdir()
    (repo / "core/core_rl.egg-info/PKG-INFO").write_text("Name: x\n")
    (repo / "core/core_rl/.a.py.swp").write_text("editor")
    (repo / "plugins/kind/p/tests/test_b.py").write_text("def test(): pass\n")
    assert _digest(repo) == clean
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git", "*.egg-info", "*.swp"))
    assert _digest(copy) == clean
    (copy / "plugins/kind/p/src/p/b.py").write_text("B = 3\n")
    assert _digest(copy) != clean


def test_a_nested_repository_counts_with_its_files(tmp_path: Path) -> None:
    """git lists an untracked nested repository as one folder: its files still count, as in a copy."""
    import shutil

    repo = tmp_path / "repo"
    for name, text in {"pyproject.toml": "", "core/a.py": "A = 1\n", "plugins/k/q/pyproject.toml": ""}.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    (repo / "plugins/k/q/src").mkdir()
    (repo / "plugins/k/q/src/q.py").write_text("Q = 1\n")
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(repo / "plugins/k/q"), "init", "-q"], check=True)
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    assert _digest(repo) == _digest(copy)
    (repo / "plugins/k/q/src/q.py").write_text("Q = 2\n")
    assert _digest(repo) != _digest(copy)
