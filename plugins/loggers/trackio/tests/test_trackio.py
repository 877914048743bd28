"""The ``trackio`` logger, local: conformance, and the project database read back with Trackio's
own storage API (in a subprocess, since Trackio fixes its directory when first imported)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any, ClassVar

import pytest

if importlib.util.find_spec("trackio") is None or importlib.util.find_spec("core_rl_trackio") is None:
    # found, not imported: importing it here would fix its settings before the fixtures set them
    pytest.skip("the trackio package or core-rl-trackio is not installed", allow_module_level=True)

import core_rl_trackio.plugin
from core_rl.testing import LoggerContract


@pytest.fixture(autouse=True, scope="module")
def _trackio_dir(tmp_path_factory):
    """Keep this process's Trackio databases in a temporary directory."""
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(tmp_path_factory.mktemp("trackio"))
    yield


class TestTrackioContract(LoggerContract):
    plugin = core_rl_trackio.plugin
    name = "trackio"
    distribution = "core-rl-trackio"
    options: ClassVar[dict[str, Any]] = {"project": "contract"}


RUN = """
import json, sys
from pathlib import Path
from core_rl.interfaces import RunInfo, SampleRecord
from core_rl_trackio.logger import TrackioLogger
from core_rl_trackio.plugin import TrackioConfig
lg = TrackioLogger(TrackioConfig(project="demo", log_dir=sys.argv[1]))
lg.start(RunInfo(name="r1", output_dir=Path(sys.argv[1]), config={"seed": 7}))
for step in (1, 2, 3):
    lg.log({"reward/mean": step / 8}, step)
lg.log_samples([SampleRecord("abc=", "zyxw", 0.25, "stop", {"format": 1.0})], 3)
lg.close()
import trackio
assert str(trackio.TRACKIO_DIR) == sys.argv[1], trackio.TRACKIO_DIR
print(json.dumps(trackio.SQLiteStorage.get_logs("demo", "r1")))
"""


def test_local_project_database_reads_back(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRACKIO_DIR"} | {"HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / "trackio")], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("[")]  # trackio prints around it
    logs = json.loads(line)
    assert [(r["step"], r["reward/mean"]) for r in logs if "reward/mean" in r] == [(1, 0.125), (2, 0.25), (3, 0.375)]
    (samples,) = [r["samples"] for r in logs if "samples" in r]
    assert samples["_value"] == [
        {"prompt": "abc=", "response": "zyxw", "reward": 0.25, "finish_reason": "stop", "reward/format": 1.0}
    ]
    assert (tmp_path / "trackio" / "demo.db").is_file()
