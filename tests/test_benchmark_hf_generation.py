"""Smoke test of ``benchmarks/hf_generation.py``: the tiny CPU run times transformers' generate
and the hf engine and prints a positive rate for each."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("core_rl_hf")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_generation.py"


def test_hf_generation_benchmark_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bench = runpy.run_path(str(SCRIPT), run_name="benchmark")
    assert bench["main"](["--smoke", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 prompts x 4 samples x 8 tokens" in out
    lines = [line for line in out.splitlines() if line.startswith(("transformers", "hf "))]
    rows = {line[:14].strip(): line[14:].split() for line in lines}
    assert set(rows) == {"transformers", "hf eager"}
    for cells in rows.values():
        seconds, rate = float(cells[0]), float(cells[1])
        # seconds are printed to 3 decimals: the rate is 64 tokens over a time within 0.0005 s of it
        assert seconds > 0 and 64 / (seconds + 0.0005) - 1 <= rate <= 64 / max(seconds - 0.0005, 1e-9) + 1
