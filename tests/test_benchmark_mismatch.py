"""Smoke test of ``benchmarks/mismatch.py``: one step of the hf engine in float32 on a tiny model
prints the table's row, with the mismatch of a float32 engine against the float32 trainer (the
same weights, the same arithmetic up to summation order) near 0."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

for _dist in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo", "core_rl_reward_match"):
    pytest.importorskip(_dist)


def _benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "mismatch.py"
    spec = importlib.util.spec_from_file_location("mismatch_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mismatch_benchmark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert _benchmark().main(["--smoke"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| hf | float32 |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    abs_diff, kl, outside = (float(cell.split()[0]) for cell in cells[2:5])
    assert 0.0 <= abs_diff < 1e-4 and 0.0 <= kl < 1e-8 and outside == 0.0
