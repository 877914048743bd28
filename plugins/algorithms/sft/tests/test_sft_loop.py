"""The ``sft`` loop end to end through ``core-rl train`` with the real ``fsdp`` engine on a tiny
model (CPU): the loss falls, only response tokens train, a SIGTERM stops the run with a checkpoint
and the resumed run ends with bitwise the same weights as an uninterrupted one. (Packed and padded
micro-batches give the same loss by the engine's own parity tests, tests/test_engine_parity.py.)"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import preloaded
from core_rl.testing.faults import wait_for_file
from core_rl.testing.launch import run_train as train
from core_rl.testing.launch import train_command
from core_rl.testing.tiny import build_tiny_model
from safetensors.torch import load_file

pytest.importorskip("core_rl_fsdp")

STRINGS = ["".join(p) for n in (2, 3) for p in itertools.product("abcd", repeat=n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sft")
    model = build_tiny_model(root / "model", alphabet="abcd=", seed=0)
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "response": s[::-1]}) + "\n" for s in STRINGS))
    config = {
        "experiment": {"name": "run", "output_dir": str(root / "runs"), "seed": 2},
        "data": {"train_files": [str(data)], "batch_size": 16},
        "actor": {"model_path": str(model), "optimizer": {"name": "adamw", "lr": 1e-2}},
        "algorithm": {"name": "sft"},
        "trainer": {"total_steps": 12, "torch_threads": 1},
        "saver": {"every_n_steps": 3, "keep_last": 1},
        "loggers": [{"name": "console"}],
    }
    path = root / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"root": root, "config": path}


def weights(run: Path) -> dict:
    return load_file(run / "final_hf" / "model.safetensors")


def test_loss_falls_and_a_signal_stop_resumes_exactly(setup):
    runs = setup["root"] / "runs"
    train(setup["config"], "experiment.name=straight")
    rows = read_metrics(runs / "straight" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["sft/loss"] < 0.75 * rows[0]["sft/loss"]
    # 16 rows of 2-3 response letters + EOS: only response tokens count
    assert 16 * 3 <= rows[0]["sft/target_tokens"] <= 16 * 4
    # SIGTERM once the first checkpoint exists: the run stops after its step with a checkpoint ...
    run = runs / "stopped"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = preloaded.Popen(
        train_command(setup["config"], "experiment.name=stopped"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_file(run / "checkpoints" / "latest", proc, timeout=300)  # the first checkpoint, or the run ended
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    stopped_at = max(r["step"] for r in read_metrics(run / "metrics.jsonl"))
    if stopped_at < 12:  # it may have finished before the signal on a fast machine
        assert proc.returncode == 3 and "stopped by SIGTERM" in err, err[-2000:]
        assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    # ... and continuing it ends with the same weights, bit for bit, and the same losses
    train(setup["config"], "experiment.name=stopped", "recover.mode=auto")
    a, b = weights(runs / "straight"), weights(run)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert [r["sft/loss"] for r in read_metrics(run / "metrics.jsonl")] == [r["sft/loss"] for r in rows]


def _conversation(s: str) -> list[dict[str, str]]:
    """Two exchanges: the reply to ``s`` is ``s`` reversed, then ``=`` is answered with ``a``."""
    return [
        {"role": "user", "content": s},
        {"role": "assistant", "content": s[::-1]},
        {"role": "user", "content": "="},
        {"role": "assistant", "content": "a"},
    ]


def test_conversations_train_on_the_assistant_turns_alone(setup, tmp_path):
    """``trainer.loop.conversations``: the loss reads each assistant turn and its end of turn
    (2 + 1 and 1 + 1 tokens a row here, never the role headers or the user turns), the loss falls,
    and a row without an assistant turn stops the run before its first step, naming the row."""
    from core_rl.testing.tiny import add_chat_template

    model = build_tiny_model(tmp_path / "model", alphabet="abcd=su:>", seed=0)
    add_chat_template(model)
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": _conversation(s)}) + "\n" for s in STRINGS if len(s) == 2))
    config = yaml.safe_load(setup["config"].read_text())
    config["experiment"] = {"name": "conversations", "output_dir": str(tmp_path / "runs"), "seed": 2}
    config["data"] = {
        "train_files": [str(data)],
        "batch_size": 8,
        "prompt_key": "messages",
        "apply_chat_template": True,
    }
    config["actor"]["model_path"] = str(model)
    config["trainer"] = {"total_steps": 10, "torch_threads": 1, "loop": {"name": "sft", "conversations": True}}
    config["saver"] = {"every_n_steps": 0, "at_end": False}
    path = tmp_path / "conversations.yaml"
    path.write_text(yaml.safe_dump(config))
    train(path)
    rows = read_metrics(tmp_path / "runs" / "conversations" / "metrics.jsonl")
    assert [r["sft/target_tokens"] for r in rows] == [8 * (3 + 2)] * 10
    assert rows[-1]["sft/loss"] < 0.6 * rows[0]["sft/loss"]
    # the config check, then a row the loop cannot train on
    proc = train(path, "data.apply_chat_template=false", expect=2)
    assert "trainer.loop.conversations: true renders each conversation with the chat template" in proc.stderr
    data.write_text(data.read_text() + json.dumps({"messages": [{"role": "user", "content": "ab"}]}) + "\n")
    proc = train(path, "experiment.name=bad", expect=2)
    line = len(data.read_text().splitlines())
    assert f"{data}:{line}: column 'messages': the conversation has no assistant message to train on" in proc.stderr
