"""The ``prompt_lm`` loop: its conformance contract, and a real run through core-rl's ``train`` with
core-rl's ``fsdp`` engine on a tiny model (the loss falls, metrics and a checkpoint are written).

The run is a fresh interpreter doing what ``core-rl train`` does; it registers the plugin module
itself when the plugin is not installed (core-rl's own test run reads it from the source tree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import core_rl_example_plugin
import core_rl_example_plugin.plugin as plugin
import yaml
from core_rl.builtin.loggers import read_metrics
from core_rl.testing import LoopContract, installed_distribution
from core_rl.tiny import build_tiny_model

TRAIN = """
import sys
from core_rl.config.loader import load_config
from core_rl.errors import PluginError
from core_rl.kinds import LOOP
from core_rl.plugins import PluginHost
from core_rl.trainer import train

host = PluginHost()
try:
    host.get(LOOP, "prompt_lm")
except PluginError:  # not installed: register the module from the source tree
    import core_rl_example_plugin.plugin as plugin

    host.register_plugin(plugin, distribution="core-rl-example-plugin")
train(load_config(sys.argv[1], host=host), host=host)
"""


class TestPromptLMLoop(LoopContract):
    plugin = plugin
    name = "prompt_lm"
    distribution = installed_distribution("core-rl-example-plugin")


def test_prompt_lm_trains_through_core_rl(tmp_path) -> None:
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
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(config))
    package_root = Path(core_rl_example_plugin.__file__).resolve().parents[1]
    pythonpath = os.pathsep.join(p for p in (str(package_root), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN, str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "lm" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["actor/loss"] < rows[0]["actor/loss"]
    assert (tmp_path / "runs" / "lm" / "checkpoints" / "step_00000005").is_dir()
