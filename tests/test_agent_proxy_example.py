"""The agent-through-the-proxy example (examples/agent_proxy): the model learns to answer with the
calculator's result in a synchronous run, and an asynchronous run (bound 1) trains through the
proxy within its staleness bound. Real parts: the ``core-rl train`` CLI, fsdp + hf + grpo, the
proxy over HTTP, the example's ``openai`` client agent."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import preloaded

for name in ("core_rl_fsdp", "core_rl_hf", "core_rl_grpo", "core_rl_openai_proxy", "openai"):
    pytest.importorskip(name)

ROOT = Path(__file__).resolve().parents[1]


def _main(work: Path, *overrides: str) -> Path:
    proc = preloaded.run(
        [sys.executable, str(ROOT / "examples" / "agent_proxy" / "main.py"), "--workdir", str(work), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reward: first" in proc.stdout
    return work / "agent_proxy"


@pytest.mark.slow
def test_the_agent_learns_to_use_the_calculator(tmp_path) -> None:
    run = _main(tmp_path / "sync", "trainer.total_steps=24")
    rewards = [r["reward/mean"] for r in read_metrics(run / "metrics.jsonl")]
    assert len(rewards) == 24
    first, last = statistics.fmean(rewards[:6]), statistics.fmean(rewards[-6:])
    assert last >= 2 * first and last >= first + 0.1, rewards


def test_an_asynchronous_run_trains_through_the_proxy(tmp_path) -> None:
    run = _main(
        tmp_path / "async",
        "trainer.total_steps=3",
        "data.batch_size=4",
        "rollout.sampling.n=4",
        "rollout.controller.max_head_offpolicyness=1",
        "sample_log.every_n_steps=1",
        "sample_log.num_samples=16",
    )
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["staleness/max"] <= 1 for m in metrics)
    assert any(m["staleness/max"] == 1 for m in metrics[1:])  # rollout ran ahead of training
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["info/calls"] == 2 and s["info/trajectories"] == 1 for s in samples)
