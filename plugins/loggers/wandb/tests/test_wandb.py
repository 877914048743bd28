"""The ``wandb`` logger, offline: conformance and ``disabled`` with no socket opened and no name
looked up in this process; ``offline`` in a network namespace (so no network is reachable
whatever W&B's background service tries) writing its run file with the logged values."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from typing import Any, ClassVar

import pytest

if importlib.util.find_spec("wandb") is None or importlib.util.find_spec("core_rl_wandb") is None:
    # found, not imported: importing it here would fix its settings before the fixtures set them
    pytest.skip("the wandb package or core-rl-wandb is not installed", allow_module_level=True)

import core_rl_wandb.plugin
from core_rl.interfaces import RunInfo, SampleRecord
from core_rl.testing import LoggerContract
from core_rl_wandb.logger import WandbLogger
from core_rl_wandb.plugin import WandbConfig


class TestWandbContract(LoggerContract):
    plugin = core_rl_wandb.plugin
    name = "wandb"
    distribution = "core-rl-wandb"
    options: ClassVar[dict[str, Any]] = {"mode": "disabled"}


def test_disabled_opens_no_socket(tmp_path, monkeypatch):
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args)
        raise OSError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    lg = WandbLogger(WandbConfig(mode="disabled"))
    lg.start(RunInfo(name="r", output_dir=tmp_path / "run", config={"a": 1}))
    lg.log({"reward/mean": 0.5}, 1)
    lg.log_samples([SampleRecord("p", "r", 1.0, "stop")], 1)
    lg.close()
    assert attempts == []
    assert not (tmp_path / "run" / "wandb").exists()


OFFLINE_RUN = """
import sys
from pathlib import Path
from core_rl.interfaces import RunInfo, SampleRecord
from core_rl_wandb.logger import WandbLogger
from core_rl_wandb.plugin import WandbConfig
lg = WandbLogger(WandbConfig(mode="offline", project="demo"))
lg.start(RunInfo(name="r", output_dir=Path(sys.argv[1]), config={"seed": 7}))
for step in (1, 2, 3):
    lg.log({"reward/mean": step / 8}, step)
lg.log_samples([SampleRecord("abc=", "zyxw", 0.25, "stop")], 3)
lg.close()
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a network namespace")
def test_offline_writes_its_run_file_without_network(tmp_path):
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")} | {"HOME": str(tmp_path)}
    proc = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", OFFLINE_RUN, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    # the history rows are protobuf records holding each key and its JSON value
    assert b"reward/mean" in data and b"0.375" in data and b"samples" in data
    (table,) = (tmp_path / "run" / "wandb").glob("offline-run-*/files/media/table/samples_3_*.table.json")
    assert json.loads(table.read_text())["data"] == [["abc=", "zyxw", 0.25, "stop"]]
