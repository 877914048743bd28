"""End-to-end training through the CLI with the real plugins (fsdp, hf, grpo, char_match) on a tiny
model: metrics, checkpoints, export, exact resume, and 2-rank training under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import preloaded
from core_rl.testing.launch import run_train
from core_rl.testing.tiny import build_tiny_model

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

REQUIRED_METRICS = {
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "actor/loss",
    "actor/entropy",
    "actor/clipped",
    "actor/grad_norm",
    "actor/lr",
    "timing/generate_s",
    "timing/train_s",
    "timing/weight_sync_s",
    "timing/step_s",
    "throughput/tokens_per_s",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in ("ab", "ba", "abc", "dca", "bd", "cc")
        )
    )
    config = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 3},
        "data": {"train_files": [str(data)], "batch_size": 2},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-2}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 4, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo", "loss": {"name": "ppo_clip", "kl_coef": 0.01}},
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": 4, "torch_threads": 1},
        "saver": {"every_n_steps": 2, "keep_last": 1},
        "loggers": [{"name": "console"}],
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"root": root, "config": path}


def _train(config: Path, *overrides: str, nproc: int = 0) -> subprocess.CompletedProcess:
    """``core-rl train``; under torchrun (``nproc``) on CPU ranks, which the rank comparisons mean."""
    return run_train(config, *overrides, nproc=nproc, cpu=bool(nproc))


@pytest.fixture(scope="module")
def straight_run(setup) -> tuple[Path, subprocess.CompletedProcess]:
    """The config's run as it is (4 steps, a checkpoint every 2): the reference of the resume and
    disk-sync comparisons too."""
    return setup["root"] / "runs" / "full", _train(setup["config"], "experiment.name=full")


def test_train_writes_metrics_checkpoints_and_model(setup, straight_run):
    run, proc = straight_run
    assert f"metrics:    {run / 'metrics.jsonl'}" in proc.stdout
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert REQUIRED_METRICS <= set(row), REQUIRED_METRICS - set(row)
        assert "actor/kl" in row  # kl_coef > 0 builds a reference model
        assert 0.0 <= row["reward/mean"] <= 1.0
    assert rows[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    # keep_last=1: only the newest checkpoint remains, and "latest" names it
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000004"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "final_hf")
    # a second fresh run into the same directory is refused (exit 2, no traceback)
    again = preloaded.run(
        [sys.executable, "-m", "core_rl.cli", "train", str(setup["config"]), "experiment.name=full"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 2 and "trainer.resume=true" in again.stderr and "Traceback" not in again.stderr


def test_resume_continues_exactly(setup, straight_run):
    runs = setup["root"] / "runs"
    _train(setup["config"], "experiment.name=resumed", "trainer.total_steps=2")
    _train(setup["config"], "experiment.name=resumed", "trainer.total_steps=4", "trainer.resume=true")
    straight = {r["step"]: r for r in read_metrics(straight_run[0] / "metrics.jsonl")}
    resumed = {r["step"]: r for r in read_metrics(runs / "resumed" / "metrics.jsonl")}
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_weight_sync_through_disk_matches_memory(setup, straight_run):
    """The straight run (weights to the hf engine in memory) and a run syncing through disk agree
    step for step (saving checkpoints does not touch the metrics: the resume test holds it)."""
    runs = setup["root"] / "runs"
    _train(
        setup["config"],
        "experiment.name=disk",
        "trainer.total_steps=3",
        "saver.every_n_steps=0",
        "rollout.weight_sync=disk",
    )
    mem = read_metrics(straight_run[0] / "metrics.jsonl")[:3]
    disk = read_metrics(runs / "disk" / "metrics.jsonl")
    assert len(disk) == 3
    for a, b in zip(mem, disk):
        for key in ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert (runs / "disk" / "weight_sync" / "config.json").is_file()


def test_two_ranks_match_one_rank(setup):
    """Data parallel, and one sequence-parallel group (``actor.engine.sequence_parallel_size: 2``,
    which the frozen reference shares): both train as one rank does."""
    runs = setup["root"] / "runs"
    _train(setup["config"], "experiment.name=one", "trainer.total_steps=2", "saver.every_n_steps=0", nproc=1)
    _train(setup["config"], "experiment.name=two", "trainer.total_steps=2", "saver.every_n_steps=0", nproc=2)
    _train(
        setup["config"],
        "experiment.name=two_sp",
        "trainer.total_steps=2",
        "saver.every_n_steps=0",
        "actor.engine.sequence_parallel_size=2",
        nproc=2,
    )
    one = read_metrics(runs / "one" / "metrics.jsonl")
    for name in ("two", "two_sp"):
        two = read_metrics(runs / name / "metrics.jsonl")
        assert len(one) == len(two) == 2
        for a, b in zip(one, two):
            for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl", "actor/tokens"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, key)


def test_a_finished_run_leaves_no_process_group_at_exit(setup):
    """``core-rl train`` destroys the process group it trained with when the interpreter exits (NCCL
    warns at exit about a group left alive): a check registered before the run, so run after the
    clean-up (exit handlers run last first), sees none."""
    script = (
        "import atexit, sys\n"
        "import torch.distributed as dist\n"
        "from core_rl import cli\n"
        "atexit.register(lambda: print('group at exit:', dist.is_initialized()))\n"
        f"code = cli.main(['train', {str(setup['config'])!r}, 'experiment.name=exit', 'trainer.total_steps=1', "
        "'saver.every_n_steps=0'])\n"
        "print('initialized after the run:', dist.is_initialized())\n"
        "sys.exit(code)\n"
    )
    proc = preloaded.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialized after the run: True" in proc.stdout  # kept for a later run in the same process ...
    assert "group at exit: False" in proc.stdout  # ... and destroyed at exit
    assert "destroy_process_group() was not called" not in proc.stderr


def test_an_engines_own_group_of_one_is_destroyed_at_exit():
    """An engine used on its own (no trainer, no torchrun) creates a one-process group; it is
    destroyed when the interpreter exits (with NCCL, a group left alive warns at every exit)."""
    script = (
        "import atexit\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "from core_rl.launch.distributed import ensure_process_group\n"
        "atexit.register(lambda: print('group at exit:', dist.is_initialized()))\n"
        "print('rank and world:', ensure_process_group('auto', torch.device('cpu')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = preloaded.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank and world: (0, 1)" in proc.stdout and "group at exit: False" in proc.stdout, proc.stdout
