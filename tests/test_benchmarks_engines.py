"""Smoke test of ``benchmarks/engines.py``: every setting runs one step on a tiny model and the table
has a row for each, with finite positive figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from core_rl.testing import preloaded

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_deepspeed")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engines.py"


def test_engines_benchmark_smoke() -> None:
    proc = preloaded.run(
        [sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("setting"))
    rows = lines[start + 1 :]
    names = [
        "fsdp full (padded)",
        "fsdp full (packed)",
        "fsdp full (all ranks load)",
        "fsdp lora r16",
        "fsdp cpu offload",
        "deepspeed zero1",
        "deepspeed zero2",
        "deepspeed zero3 (padded)",
        "deepspeed zero3 (packed)",
        "deepspeed zero3 (no zero.Init)",
    ]
    assert [row[:30].strip() for row in rows] == names
    for row in rows:
        step_s, cpu_s, tokens_s, peak, _build, trained = (float(x) for x in row[30:].split())
        assert step_s > 0 and cpu_s > 0 and tokens_s > 0 and peak > 0 and trained > 0, row
    assert float(rows[3].split()[-1]) < float(rows[0].split()[-1])  # LoRA trains fewer parameters
