"""The ``prompt_lm`` loop: its conformance contract, and a real run through core-rl's ``train`` with
core-rl's ``fsdp`` engine on a tiny model (the loss falls, metrics and a checkpoint are written).

The run is a fresh interpreter doing what ``core-rl train`` does; it registers the plugin module
itself when the plugin is not installed (core-rl's own test run reads it from the source tree)."""

from __future__ import annotations

import json

import core_rl_example_plugin.plugin as plugin
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import LoopContract, installed_distribution
from core_rl.testing.tiny import build_tiny_model


class TestPromptLMLoop(LoopContract):
    plugin = plugin
    name = "prompt_lm"
    distribution = installed_distribution("core-rl-example-plugin")


def test_prompt_lm_trains_through_core_rl(tmp_path, train_run) -> None:
    model = build_tiny_model(tmp_path / "model", alphabet="abcd ", seed=0)
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"prompt": "abcd abcd"[i:] + " dcba"}) + "\n" for i in range(8)))
    config = {
        "experiment": {"name": "lm", "output_dir": str(tmp_path / "runs")},
        "data": {"train_files": [str(data)], "batch_size": 4},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"lr": 1e-2}},
        "trainer": {"total_steps": 5, "torch_threads": 1, "loop": {"name": "prompt_lm"}},
        "saver": {"export_hf": False},
        "loggers": [{"name": "console"}],
    }
    run_dir = train_run(config)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["actor/loss"] < rows[0]["actor/loss"]
    assert (run_dir / "checkpoints" / "step_00000005").is_dir()
