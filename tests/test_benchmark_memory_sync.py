"""Smoke test of benchmarks/memory_sync.py: a 2-layer model on the CPU, both layouts, its figures and
profiles printed (the 0.36B layout's figures are in docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from core_rl.testing import preloaded

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_sync.py"


def test_memory_sync_benchmark_smoke() -> None:
    pytest.importorskip("core_rl_fsdp")
    pytest.importorskip("core_rl_hf")
    command = [sys.executable, str(SCRIPT), "--smoke", "--profile", "8"]
    proc = preloaded.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {cells[1]: cells[2:] for cells in map(str.split, proc.stdout.splitlines()) if cells[:1] == ["smoke"]}
    assert set(rows) == {"plain", "sharded"}, proc.stdout
    for tensors, megabytes, ms, rate, check_ms in (map(float, row) for row in rows.values()):
        # per Qwen2 layer: q, k, v (weights and biases), o, gate, up, down, 2 norms; then the embedding,
        # the final norm and the head tied to the embedding (a name of its own, its bytes counted once)
        assert tensors == 2 * 12 + 3 and megabytes > 0 and ms > 0 and rate > 0 and check_ms > 0
    # --profile: after each layout, torch's profiler table of 3 syncs, the copies among its rows
    profiled = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["sync"]]
    assert len(profiled) == 2 and all(row[-1] == "3" for row in profiled), proc.stdout
    assert proc.stdout.count("aten::_foreach_copy_") == 2, proc.stdout
