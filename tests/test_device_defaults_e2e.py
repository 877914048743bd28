"""Real runs through the CLI (fsdp, hf, grpo on a tiny model): ``max_tokens_per_mb: auto`` resolved at
the start and printed, an explicit value kept, ``auto`` kept in ``config show`` and ``<run>/config.yaml``,
the memory figures of every step in ``metrics.jsonl`` and the peak in the run's summary; on CPU
ranks (one and two, under torchrun) and, where there is one, on a CUDA GPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing.launch import run_train
from core_rl.testing.tiny import build_tiny_model

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

# a tiny model's activations are far below the CPU's 256 MiB at any budget: the largest, 2048
CPU_LINE = "core-rl: actor.micro_batch.max_tokens_per_mb: auto -> 2048 (cpu, 0.1M parameters)"
GPU_LINE = re.compile(
    r"core-rl: actor\.micro_batch\.max_tokens_per_mb: auto -> (\d+) \(cuda:0, [\d.]+ GiB free, [\d.]+[MB] parameters\)"
)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("device-defaults")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in ("ab", "ba", "abc")))
    cfg = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 3},
        "data": {"train_files": [str(data)], "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo", "loss": {"name": "ppo_clip", "kl_coef": 0.01}},  # a ref from the actor's section
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": 2, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": True, "export_hf": False},
        "loggers": [{"name": "jsonl"}],
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run_dir(config: Path, name: str) -> Path:
    return config.parent / "runs" / name


def _memory_rows(run: Path) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if k.startswith("memory/")} for row in read_metrics(run / "metrics.jsonl")]


def test_auto_on_a_cpu_is_printed_recorded_as_auto_and_chosen_again_on_resume(config):
    proc = run_train(config, "experiment.name=auto", cpu=True)
    assert proc.stderr.count("max_tokens_per_mb: auto ->") == 1 and CPU_LINE in proc.stderr.splitlines()
    run = _run_dir(config, "auto")
    recorded = (run / "config.yaml").read_text()
    assert "    max_tokens_per_mb: auto  # derived: 2048 = 256 MiB / " in recorded
    rows = _memory_rows(run)
    assert len(rows) == 2 and all(set(r) == {"memory/host_peak_rss_gib", "memory/host_rss_gib"} for r in rows)
    assert all(0.05 < r["memory/host_rss_gib"] <= r["memory/host_peak_rss_gib"] < 64 for r in rows)
    peak = rows[-1]["memory/host_peak_rss_gib"]  # the process's peak so far: it never falls
    assert rows[0]["memory/host_peak_rss_gib"] <= peak
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("peak memory: host ")]
    assert peak - 0.005 <= float(line.split()[3])  # and the checkpoint after the last step
    shown = subprocess.run(
        [sys.executable, "-m", "core_rl.cli", "config", "show", str(run / "config.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "    max_tokens_per_mb: auto\n" in shown.stdout
    resumed = run_train(config, "experiment.name=auto", "recover.mode=resume", "trainer.total_steps=3", cpu=True)
    # chosen again, and not among the changed or recomputed settings the resume reports
    assert CPU_LINE in resumed.stderr.splitlines() and resumed.stderr.count("max_tokens_per_mb") == 1
    assert "trainer.total_steps: 2 -> 3" in resumed.stderr


def test_an_explicit_budget_wins(config):
    proc = run_train(config, "experiment.name=explicit", "actor.micro_batch.max_tokens_per_mb=64", cpu=True)
    assert "max_tokens_per_mb: auto" not in proc.stderr
    assert "    max_tokens_per_mb: 64\n" in (_run_dir(config, "explicit") / "config.yaml").read_text()


def test_two_ranks_choose_once_and_log_memory(config):
    proc = run_train(config, "experiment.name=two", nproc=2, cpu=True)
    assert proc.stderr.count("max_tokens_per_mb: auto ->") == 1 and CPU_LINE in proc.stderr.splitlines()
    rows = _memory_rows(_run_dir(config, "two"))
    assert len(rows) == 2 and all(r["memory/host_peak_rss_gib"] > 0.05 for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_auto_is_chosen_from_free_memory_and_memory_is_logged(config):
    proc = run_train(config, "experiment.name=gpu")
    found = [m for line in proc.stderr.splitlines() if (m := GPU_LINE.fullmatch(line))]
    assert len(found) == 1, proc.stderr[-3000:]
    budget = int(found[0].group(1))
    assert 1024 <= budget <= 16384 and budget % 128 == 0
    run = _run_dir(config, "gpu")
    assert f"    max_tokens_per_mb: auto  # derived: {budget} = 0.5 x (free " in (run / "config.yaml").read_text()
    for row in _memory_rows(run):
        for role in ("actor", "ref"):  # one device: the same figure
            assert 0 < row[f"memory/{role}/peak_gib"] <= row[f"memory/{role}/reserved_gib"]
        assert row["memory/ref/peak_gib"] == row["memory/actor/peak_gib"]
        assert row["memory/host_peak_rss_gib"] > 0.05
    assert any(line.startswith("peak memory: cuda:0 (actor, ref) ") for line in proc.stdout.splitlines())
