"""Smoke test of benchmarks/sequence_parallel.py: a short row through 1 rank and through a group of
2 (gloo), each rank's figures printed; each rank of the group keeps about half the activations for
backward (the full-size figures are in docs/benchmarks.md); torchrun's log folders go with the run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from core_rl.testing import preloaded

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sequence_parallel.py"


def test_sequence_parallel_benchmark_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, str(SCRIPT), "--smoke"]
    proc = preloaded.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list(tmp_path.glob("torchelastic_*"))  # the elastic agent's own, never removed by it
    rows = {}
    for line in proc.stdout.splitlines():
        cells = line.split()
        if len(cells) == 5 and cells[0].isdigit():
            rows[(int(cells[0]), int(cells[1]))] = [float(c) for c in cells[2:]]
    assert sorted(rows) == [(1, 0), (2, 0), (2, 1)], proc.stdout
    alone = rows[(1, 0)][0]
    for rank in (0, 1):
        saved, peak, seconds = rows[(2, rank)]
        assert 0.4 * alone < saved < 0.6 * alone, proc.stdout
        assert peak >= 0 and seconds > 0
