"""The ``swanlab`` logger for real, offline: conformance, files written in offline and local mode
read back with SwanLab's own reader, nothing written when disabled, no connection attempted, and a
clear error (no prompt, no hang) in cloud mode without a key."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

if importlib.util.find_spec("swanlab") is None or importlib.util.find_spec("core_rl_swanlab") is None:
    # found, not imported: importing it here would fix its settings before the fixtures set them
    pytest.skip("the swanlab package or core-rl-swanlab is not installed", allow_module_level=True)

import core_rl_swanlab.plugin
from core_rl.interfaces import RunInfo, SampleRecord
from core_rl.testing import LoggerContract
from core_rl_swanlab.logger import SwanlabLogger
from core_rl_swanlab.plugin import SwanlabConfig


class TestSwanlabContract(LoggerContract):
    plugin = core_rl_swanlab.plugin
    name = "swanlab"
    distribution = "core-rl-swanlab"
    options: ClassVar[dict[str, Any]] = {"mode": "offline"}


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """key -> {step: value} from the run file SwanLab wrote under ``log_dir``."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (run_file,) = log_dir.glob("run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(run_file)
    out: dict[str, dict[int, float]] = {}
    while (data := reader.scan()) is not None:
        record = Record()
        record.ParseFromString(data)
        if record.HasField("scalar"):
            out.setdefault(record.scalar.key, {})[record.scalar.step] = record.scalar.value.number
    reader.close()
    return out


class NetworkWatch:
    """Records every socket connect and name lookup made in this process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.connects: list[Any] = []
        self.lookups: list[Any] = []
        real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

        def connect(sock: socket.socket, address: Any) -> Any:
            self.connects.append(address)
            return real_connect(sock, address)

        def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
            self.lookups.append(host)
            return real_getaddrinfo(host, *args, **kwargs)

        monkeypatch.setattr(socket.socket, "connect", connect)
        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    def external(self) -> list[Any]:
        local = ("127.0.0.1", "::1", "localhost")
        return [a for a in self.connects if isinstance(a, tuple) and a[0] not in local] + [
            h for h in self.lookups if h not in local
        ]


def _run(tmp_path: Path, **options: Any) -> SwanlabLogger:
    lg = SwanlabLogger(SwanlabConfig(**options))
    lg.start(RunInfo(name="demo", output_dir=tmp_path / "run", config={"trainer": {"total_steps": 3}}))
    for step in (1, 2, 3):
        lg.log({"reward/mean": step / 4, "actor/loss": -step}, step)
    lg.log_samples([SampleRecord("abc=", "cba", 1.0, "stop", {"char_match": 1.0})], 3)
    lg.close()
    return lg


@pytest.mark.parametrize("mode", ["offline", "local"])
def test_writes_its_run_files_and_no_network(tmp_path, monkeypatch, mode):
    watch = NetworkWatch(monkeypatch)
    lg = _run(tmp_path, mode=mode)
    assert lg.log_dir == tmp_path / "run" / "swanlab"
    scalars = read_scalars(lg.log_dir)
    assert scalars["reward/mean"] == {1: 0.25, 2: 0.5, 3: 0.75}
    assert scalars["actor/loss"] == {1: -1.0, 2: -2.0, 3: -3.0}
    (table,) = lg.log_dir.glob("run-*/media/echarts/*.json")
    assert "cba" in table.read_text() and "char_match" in table.read_text()
    assert watch.external() == []


def test_log_dir_option(tmp_path):
    _run(tmp_path, mode="offline", log_dir=str(tmp_path / "elsewhere"))
    assert read_scalars(tmp_path / "elsewhere")["reward/mean"][3] == 0.75


def test_disabled_writes_nothing(tmp_path, monkeypatch):
    watch = NetworkWatch(monkeypatch)
    lg = _run(tmp_path, mode="disabled")
    assert list(lg.log_dir.rglob("*")) == []
    assert watch.connects == [] and watch.lookups == []


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a network namespace")
def test_cloud_without_a_key_is_a_clear_error_not_a_prompt(tmp_path):
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    code = (
        "from pathlib import Path\n"
        "from core_rl.interfaces import RunInfo\n"
        "from core_rl_swanlab.logger import SwanlabLogger\n"
        "from core_rl_swanlab.plugin import SwanlabConfig\n"
        "lg = SwanlabLogger(SwanlabConfig(mode='cloud'))\n"
        f"lg.start(RunInfo(name='r', output_dir=Path({str(tmp_path)!r}), config={{}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWANLAB")}
    env["HOME"] = str(tmp_path)  # no stored login
    proc = subprocess.run(
        ["unshare", "-rn", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert "logger 'swanlab' could not start in mode cloud" in proc.stderr and "SWANLAB_API_KEY" in proc.stderr


def test_table_json_is_valid(tmp_path):
    lg = _run(tmp_path, mode="offline")
    (table,) = lg.log_dir.glob("run-*/media/echarts/*.json")
    json.loads(table.read_text())
