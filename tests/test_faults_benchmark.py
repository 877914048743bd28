"""Smoke test of the reliability report (``python -m benchmarks.faults --quick``): a SIGTERM at a
random moment resumed bitwise, and a reward misbehaving in every survivable way plus a wrong count."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from core_rl.testing import preloaded

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")

ROOT = Path(__file__).resolve().parents[1]


def test_quick_report(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = preloaded.run(
        [sys.executable, "-m", "benchmarks.faults", "--quick", "--json", str(out), "--workdir", str(tmp_path / "w")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| **total** |" in proc.stdout
    outcomes = {o["scenario"].split()[0]: o for o in json.loads(out.read_text())}
    assert set(outcomes) == {"SIGTERM", "reward"}
    for o in outcomes.values():
        assert o["injected"] >= 1 and o["survived"] + o["detected"] == o["injected"], o
        assert o["steps_lost"] == 0 and o["bitwise"] == o["resumes"], o
    assert outcomes["SIGTERM"]["resumes"] == 1 and outcomes["SIGTERM"]["bitwise"] == 1
    reward = outcomes["reward"]
    assert reward["detected"] == 1  # the wrong count
    assert reward["survived"] == reward["injected"] - 1 >= 6
