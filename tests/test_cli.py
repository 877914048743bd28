"""The ``core-rl`` command: help everywhere, exit codes, messages without tracebacks."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from core_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]


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


def record_stderr(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each ``write`` to ``sys.stderr`` from here on, as a list (the stream made a recorder). Called
    in the test's body: pytest's output capture sets ``sys.stderr`` again after fixtures."""
    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    return writes


def test_an_error_is_one_write_with_its_newline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The message of a failed command reaches stderr in one write, newline included: ranks of one
    run share a stderr, and under ``PYTHONUNBUFFERED`` ``print`` writes the text and the newline
    apart, so another rank's line could land between them (two lines run together)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"actor": {"optimizer": {"lr": "fast"}}}))
    stderr_writes = record_stderr(monkeypatch)
    assert main(["config", "validate", str(path)]) == 2
    errors = [w for w in stderr_writes if "core-rl: error:" in w]
    assert len(errors) == 1 and errors[0].startswith("core-rl: error: ") and errors[0].endswith("\n"), stderr_writes
    assert "actor.optimizer.lr: expected a number, got 'fast'" in errors[0]


def _prints_to_stderr(path: Path) -> list[int]:
    """The lines of ``path`` holding a ``print(..., file=sys.stderr)`` of one line (no ``end=``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            target = next((k.value for k in node.keywords if k.arg == "file"), None)
            ends = any(k.arg == "end" for k in node.keywords)
            if isinstance(target, ast.Attribute) and target.attr == "stderr" and not ends:
                found.append(node.lineno)
    return found


def _imports_core_rl(path: Path) -> bool:
    """Whether the module at ``path`` imports ``core_rl`` or one of its modules."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "core_rl" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "core_rl":
            return True
    return False


def test_lines_for_stderr_are_one_write_each_in_the_core_and_the_plugins_it_runs():
    """The core, and every plugin module that runs beside it (those importing ``core_rl``: not the
    scripts run inside a server's or a sandbox's own interpreter), write a line to stderr with
    ``core_rl.errors.stderr_line`` (or ``warn``): one write with its newline, so the lines of ranks
    sharing a stderr never run together. A ``print(..., file=sys.stderr)`` would write the text and
    the newline apart."""
    import core_rl

    files = list(Path(core_rl.__file__).parent.rglob("*.py"))
    files += [path for path in (ROOT / "plugins").glob("*/*/src/**/*.py") if _imports_core_rl(path)]
    assert len(files) > 300
    offenders = {str(path): lines for path in files if (lines := _prints_to_stderr(path))}
    assert offenders == {}


def test_a_stderr_line_is_one_write_and_a_print_is_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """What the check above relies on: under an unbuffered stream ``print`` makes two writes."""
    from core_rl.errors import stderr_line, warn

    stderr_writes = record_stderr(monkeypatch)
    stderr_line("core-rl: note: a")
    warn("b")
    assert stderr_writes == ["core-rl: note: a\n", "core-rl: warning: b\n"]
    stderr_writes.clear()
    print("c", file=sys.stderr)
    assert stderr_writes == ["c", "\n"]
    probe = tmp_path / "probe.py"
    probe.write_text('import sys\nprint("x", file=sys.stderr)\nprint("y", end="", file=sys.stderr)\n')
    assert _prints_to_stderr(probe) == [2]
