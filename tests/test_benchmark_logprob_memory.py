"""Smoke test of benchmarks/logprob_memory.py at a small size: each formulation runs in its own
process and prints its figures, the chunked one gives log-probs and entropies identical to the
reference's, and the chunked ones (the core's, the fused head's and megatron's, where installed) keep less for
backward (the full-size figures are in docs/benchmarks.md; at this size the peak resident memory moves by
more than the difference between them, so it is printed, not compared)."""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path

from core_rl.testing import preloaded

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "logprob_memory.py"


def test_logprob_memory_benchmark_smoke() -> None:
    proc = preloaded.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        cells = line.split()
        if cells and cells[0] in ("reference", "chunked", "fused", "vocab_parallel"):
            rows[cells[0]] = [float(c.replace(",", "")) for c in cells[1:]]
    expected = {"reference", "chunked", "fused"} | ({"vocab_parallel"} if find_spec("core_rl_megatron") else set())
    assert set(rows) == expected, proc.stdout
    (ref_peak, ref_saved, ref_per_token, ref_s), (peak, saved, per_token, s) = rows["reference"], rows["chunked"]
    assert 0 < saved < ref_saved and 0 < per_token < ref_per_token and ref_s > 0 and s > 0
    assert ref_peak >= 0 and peak >= 0
    assert "identical log-probs and entropies: True" in proc.stdout
    for name in ("fused", "vocab_parallel"):
        if name in rows:
            assert 0 < rows[name][1] < ref_saved
            assert f"the {name} formulation against the reference: largest log-prob difference" in proc.stdout
