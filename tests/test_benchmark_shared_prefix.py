"""Smoke test of ``benchmarks/shared_prefix.py`` on the real model (the root conftest's
``real_model``: SmolLM2-135M-Instruct): both layouts run, the shared one on fewer tokens than the
padded one (two samples share one prompt), and every timed call is printed."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from core_rl.testing import preloaded

pytest.importorskip("core_rl_fsdp")

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "shared_prefix.py"


def test_shared_prefix_benchmark_smoke(real_model: Path) -> None:
    command = [
        sys.executable,
        str(BENCHMARK),
        "--prompts",
        "1",
        "--samples",
        "2",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
    ]
    proc = preloaded.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = {
        m["layout"]: int(m["tokens"])
        for m in re.finditer(r"^(?P<layout>\w+): runner layout (?P=layout), \d+ micro-batches, (?P<tokens>\d+) tokens$",
                             proc.stdout, flags=re.M)
    }  # fmt: skip
    assert set(tokens) == {"padded", "shared"} and tokens["shared"] < tokens["padded"], proc.stdout
    for layout in ("padded", "shared"):
        for call in ("train_step", "compute_logprobs"):
            assert re.search(rf"^ *{layout} +{call}: mean [\d.]+ s", proc.stdout, flags=re.M), proc.stdout
