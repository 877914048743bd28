"""Make ``core_rl_example_plugin`` importable when these tests run from a source checkout without the
plugin installed (core-rl's own test run). Installed (``pip install -e .``), the installed copy is
used and the contracts also check the entry points declared in ``pyproject.toml``.

``train_run`` runs core-rl's ``train`` on a configuration in a fresh interpreter, as ``core-rl
train`` would, registering the plugin module itself when the plugin is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

if importlib.util.find_spec("core_rl_example_plugin") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TRAIN = """
import importlib.metadata as md
import sys
from core_rl.config.loader import load_config
from core_rl.plugins.host import PluginHost
from core_rl.loops import train

host = PluginHost()
try:
    md.distribution("core-rl-example-plugin")
except md.PackageNotFoundError:  # not installed: register the module from the source tree
    import core_rl_example_plugin.plugin as plugin

    host.register_plugin(plugin, distribution="core-rl-example-plugin")
train(load_config(sys.argv[1], host=host), host=host)
"""


@pytest.fixture
def train_run(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    """``train_run(config)``: train on ``config`` (a dict; its run directory is
    ``experiment.output_dir/experiment.name``), assert it exited 0 and return the run directory."""

    def run(config: dict[str, Any]) -> Path:
        import core_rl_example_plugin

        path = tmp_path / "run.yaml"
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
        return Path(config["experiment"]["output_dir"]) / config["experiment"]["name"]

    return run
