"""Smoke test of ``benchmarks/openai_proxy.py``: both settings, one at a time and at once, give
finite positive seconds per call, and the three program modes positive seconds per episode."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from core_rl.testing import preloaded

for name in ("core_rl_hf", "core_rl_openai_proxy", "openai"):
    pytest.importorskip(name)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "openai_proxy.py"


def test_openai_proxy_benchmark_smoke() -> None:
    proc = preloaded.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("setting"))
    modes = next(i for i, line in enumerate(lines) if line.startswith("program"))
    rows = [line.split() for line in lines[start + 1 : modes] if line.strip()]
    programs = [line.split() for line in lines[modes + 1 :]]
    assert [(r[0], r[1]) for r in programs] == [
        (name, n) for name in ("in-process", "worker", "script") for n in ("1", "4")
    ]
    assert all(float(r[2]) > 0 for r in programs)
    assert [(r[0], r[1]) for r in rows] == [("direct", "1"), ("proxy", "1"), ("direct", "8"), ("proxy", "8")]
    assert all(float(r[2]) > 0 for r in rows)
    assert float(rows[0][3]) == 0.0 and float(rows[2][3]) == 0.0
