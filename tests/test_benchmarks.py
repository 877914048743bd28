"""Smoke test of benchmarks/algorithms.py at a small size: every case runs, prints its throughput
and agrees with its reference formulation (the full-size figures are in docs/benchmarks.md)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

pytest.importorskip("core_rl_grpo")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "algorithms.py"


def test_algorithms_benchmark_smoke(capsys):
    bench = runpy.run_path(str(SCRIPT), run_name="benchmark")
    assert bench["main"](["--tokens", "3000", "--response-len", "24", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    names = [case.name for case in bench["cases"](24)]
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dapo", "sapo", "cispo", "gmpo"} <= set(names)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in names}
    assert set(rows) == set(names)
    for name, cells in rows.items():
        vectorised, reference = (float(c.replace(",", "")) for c in cells[1:3])
        assert vectorised > 0 and reference > 0, name
        assert float(cells[-2]) < 1e-5 and float(cells[-1]) < 1e-6, (name, cells)  # |d loss|, |d grad|
    assert re.search(r"largest gradient difference to the reference: \S+", out)
