"""``scripts/gpu_check.sh`` and ``scripts/junit_summary.py`` on a machine without a GPU: the check refuses
loudly (a GPU check that skipped every GPU test would prove nothing), and the JUnit summary gives the
files a suite cut short by a machine's time limit can leave out when it goes on."""

from __future__ import annotations

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
</testsuite></testsuites>
"""


def test_passed_files_are_those_without_a_failure_or_error(tmp_path: Path) -> None:
    for name in ("tests/test_a.py", "tests/test_b.py", "plugins/engines/fsdp/tests/test_gpu.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "plugins/rewards/math/tests").mkdir(parents=True)
    (tmp_path / "plugins/rewards/math/tests/test_extract.py").write_text("")
    (tmp_path / "suite.xml").write_text(JUNIT)
    script = ROOT / "scripts" / "junit_summary.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--passed-files", "suite.xml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["plugins/engines/fsdp/tests/test_gpu.py", "tests/test_a.py"]
    summary = subprocess.run([sys.executable, str(script), "suite.xml"], capture_output=True, text=True, cwd=tmp_path)
    assert summary.returncode == 1 and "3 passed, 1 failed, 2 error, 1 skipped" in summary.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_gpu_check_refuses_without_cuda(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "gpu"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing ran
