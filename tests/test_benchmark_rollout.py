"""Smoke test of benchmarks/rollout.py: one tiny run through a real vLLM server prints every figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from core_rl.testing import preloaded

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.server_env("vllm")


def test_rollout_benchmark_runs_and_reports(tmp_path: Path) -> None:
    pytest.importorskip("core_rl_vllm")
    pytest.importorskip("core_rl_fsdp")
    out = tmp_path / "figures.json"
    proc = preloaded.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "rollout.py"),
            "--engines",
            "vllm",
            "--prompts",
            "8",
            "--n",
            "2",
            "--max-new-tokens",
            "8",
            "--repeats",
            "1",
            "--sync-models",
            "tiny",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "vllm: plugin" in proc.stdout and "overhead" in proc.stdout
    assert "weight sync, tiny model" in proc.stdout
    figures = json.loads(out.read_text())["vllm"]
    t, s = figures["throughput"], figures["sync_tiny"]
    assert t["plugin_tokens_per_s"] > 0 and t["plain_tokens_per_s"] > 0 and t["plain_httpx_pool_tokens_per_s"] > 0
    assert s["disk_s"] > 0 and s["collective_s"] > 0 and s["bytes"] > 0
    assert s["link_s"] > 0 and s["link_bytes_per_s"] > 0 and s["collective_bytes_per_s"] > 0
    # a bfloat16 server receives the float32 trainer's weights in its own dtype: half the bytes
    assert s["bytes"] == 2 * s["params"]
    assert "on the wire" in proc.stdout and "the link alone" in proc.stdout
    # the sync check after each update: timed, and a share of the sync it follows
    assert 0 < s["check_disk_s"] and 0 < s["check_collective_s"]
    assert 0 < s["check_disk_share"] < 1 and 0 < s["check_collective_share"] < 1
    assert "the sync check" in proc.stdout
