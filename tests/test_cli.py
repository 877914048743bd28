"""The ``core-rl`` command: help everywhere, exit codes, messages without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_rl.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "core_rl.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["train", "--help"],
        ["plugins", "--help"],
        ["config", "--help"],
        ["config", "show", "--help"],
        ["config", "validate", "--help"],
    ],
)
def test_help_everywhere(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 0
    assert "usage: core-rl" in capsys.readouterr().out


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_plugins_lists_builtins_with_status():
    proc = _run("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(proc.stdout)}
    assert rows[("logger", "jsonl")]["distribution"] == "core-rl"
    assert rows[("logger", "console")]["status"] == "loaded"
    table = _run("plugins")
    assert table.returncode == 0 and "jsonl" in table.stdout and "distribution" in table.stdout


def test_config_error_exits_2_with_short_message(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"actor": {"optimizer": {"lr": "fast"}}, "loggers": [{"name": "jsonl"}]}))
    proc = _run("config", "validate", str(path), "trainer.total_steps=0")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "actor.optimizer.lr: expected a number, got 'fast'" in proc.stderr
    assert "trainer.total_steps: must be in [1, 1000000000], got 0" in proc.stderr
    proc = _run("train", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_an_error_is_one_write_with_its_newline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The message of a failed command reaches stderr in one write, newline included: ranks of one
    run share a stderr, and under ``PYTHONUNBUFFERED`` ``print`` writes the text and the newline
    apart, so another rank's line could land between them (two lines run together)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"actor": {"optimizer": {"lr": "fast"}}}))
    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    assert main(["config", "validate", str(path)]) == 2
    errors = [w for w in writes if "core-rl: error:" in w]
    assert len(errors) == 1 and errors[0].startswith("core-rl: error: ") and errors[0].endswith("\n"), writes
    assert "actor.optimizer.lr: expected a number, got 'fast'" in errors[0]
