"""``core-rl train`` on the tiny Qwen3-MoE (fsdp + hf + grpo) with routing replay, and what
``config validate`` says about replay with engines that cannot do it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from core_rl import cli
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import preloaded
from core_rl.testing.launch import run_train
from core_rl.testing.tiny import build_tiny_model

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moe_grpo")
    model = build_tiny_model(root / "model", alphabet="abcd=", architecture="qwen3_moe", num_layers=2, seed=0)
    data = root / "train.jsonl"
    rows = ("ab", "ba", "abc", "dca", "bd", "cc")
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s[::-1]}) + "\n" for s in rows))
    cfg = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 3},
        "data": {"train_files": [str(data)], "batch_size": 2},
        "actor": {
            "model_path": str(model),
            "engine": {"name": "fsdp"},
            "optimizer": {"name": "adamw", "lr": 1e-2},
            "moe": {"routing_replay": "rollout", "router_aux_loss_coef": 0.01},
        },
        # a bf16 rollout routes some tokens differently from the float32 trainer
        "rollout": {"engine": {"name": "hf", "autocast_dtype": "bfloat16"}, "sampling": {"n": 4, "max_new_tokens": 4}},
        "algorithm": {"name": "grpo", "loss": {"name": "ppo_clip"}},
        "reward": {"name": "char_match"},
        "trainer": {"total_steps": 2, "torch_threads": 1},
        "saver": {"every_n_steps": 0, "at_end": False},
        "loggers": [{"name": "console"}],
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_grpo_on_the_tiny_moe_with_rollout_routing_replay(config: Path) -> None:
    run_train(config, "experiment.name=replay")
    rows = read_metrics(config.parent / "runs" / "replay" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("mismatch/abs_logprob_diff" in row for row in rows)
    updated = [row for row in rows if "actor/entropy" in row]  # a step whose rewards all tie skips its update
    assert updated
    for row in updated:
        assert 0.0 < row["actor/moe/routing_agreement"] <= 1.0
        assert {"actor/moe/routing_agreement/layer0", "actor/moe/routing_agreement/layer1"} <= row.keys()
        assert row["actor/moe/imbalance"] >= 1.0
        assert row["actor/moe/aux_loss"] > 0.0


def _validate(config: Path, *overrides: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["config", "validate", str(config), *overrides])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_config_validate_accepts_replay_with_fsdp_and_hf(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _validate(config, capsys=capsys)[0] == 0


def test_config_validate_refuses_replay_with_a_train_engine_that_cannot(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("core_rl_megatron")
    code, out = _validate(config, "actor.engine={name: megatron}", capsys=capsys)
    assert code == 2
    assert "actor.moe.routing_replay: rollout needs a train engine that replays" in out and "'megatron'" in out


def test_config_validate_refuses_rollout_routes_from_an_engine_that_cannot_return_them(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("core_rl_vllm")
    code, out = _validate(config, "rollout.engine={name: vllm}", capsys=capsys)
    assert code == 2
    assert "actor.moe.routing_replay: rollout needs routed experts" in out and "'vllm'" in out
    code, out = _validate(
        config, "rollout.engine={name: vllm}", "actor.moe.routing_replay=first_forward", capsys=capsys
    )
    assert "routed experts" not in out  # R2 replays the trainer's own routes: any rollout engine


def test_the_moe_example_prints_both_mismatch_curves(tmp_path: Path) -> None:
    main = Path(__file__).resolve().parents[1] / "examples" / "moe_grpo" / "main.py"
    args = ["--workdir", str(tmp_path / "work"), "--steps", "2", "--warm-steps", "5"]
    proc = preloaded.run(
        [sys.executable, str(main), *args, "data.batch_size=4"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "mismatch, replay" in line)
    first = lines[header + 1].split()
    assert first[0] == "1" and all(float(cell) >= 0 for cell in first[1:3])  # both runs measured step 1
    assert any(line.startswith("mean |train - rollout| log-prob: replay") for line in lines)


def test_routes_travel_through_async_rollout_and_saved_rollouts(config: Path) -> None:
    """An asynchronous run (one version of staleness) dumps its rollouts; a second run trains on
    those saved rollouts (``rollout.replay_from``) and replays the routes saved with them."""
    dump = config.parent / "dump"
    run_train(
        config,
        "experiment.name=async",
        "rollout.controller.max_head_offpolicyness=1",
        "rollout.dump.every_n_steps=1",
        f"rollout.dump.dir={dump}",
    )
    rows = read_metrics(config.parent / "runs" / "async" / "metrics.jsonl")
    assert sorted(p.name for p in dump.iterdir()) == ["step_00000001.parquet", "step_00000002.parquet"]
    run_train(config, "experiment.name=from_dump", f"rollout.replay_from={dump}")
    replayed = read_metrics(config.parent / "runs" / "from_dump" / "metrics.jsonl")
    key = "actor/moe/routing_agreement"
    # step 1: the same rollouts against the same starting weights, so the same agreement, read from the
    # saved routes; high, as only bf16 rounding separates the rollout's routers from the trainer's
    assert replayed[0][key] == rows[0][key] and rows[0][key] > 0.9
    # step 2 trains on rollouts of the weights before step 1 (one version stale): on this tiny model one
    # AdamW step at lr 1e-2 re-routes most tokens, which replay hides from the update but the metric shows
    assert all(0.0 <= row[key] <= 1.0 for row in [*rows, *replayed] if "actor/entropy" in row)


def test_a_run_with_routing_replay_resumes_bitwise(config: Path) -> None:
    """Three steps at once, and one step then a resume to three: the same metrics (the routing
    agreement and expert loads among them) and bitwise the same weights and optimizer state, so
    replay holds nothing a checkpoint leaves out. (An asynchronous run resumes by regenerating
    what was in flight, with the newer weights, so it is not bitwise the same by design.)"""
    from core_rl.testing.faults import same_run

    runs = config.parent / "runs"
    run_train(config, "experiment.name=whole", "trainer.total_steps=3", "saver.at_end=true")
    run_train(config, "experiment.name=part", "trainer.total_steps=1", "saver.at_end=true")
    run_train(config, "experiment.name=part", "trainer.total_steps=3", "saver.at_end=true", "recover.mode=resume")
    assert any("actor/moe/routing_agreement" in row for row in read_metrics(runs / "whole" / "metrics.jsonl"))
    assert same_run(runs / "whole", runs / "part", 3)
