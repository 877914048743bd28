"""The built-in loggers pass the conformance kit and write what they promise."""

from __future__ import annotations

import io
import json

import pytest
from core_rl.builtin import loggers
from core_rl.builtin.loggers import ConsoleLogger, ConsoleLoggerConfig, JsonlLogger, JsonlLoggerConfig, read_metrics
from core_rl.errors import CoreRLError
from core_rl.interfaces import RunInfo
from core_rl.testing import LoggerContract


class TestConsoleConformance(LoggerContract):
    plugin = loggers
    name = "console"
    distribution = "core-rl"


class TestJsonlConformance(LoggerContract):
    plugin = loggers
    name = "jsonl"
    distribution = "core-rl"


def test_jsonl_writes_one_line_per_step(tmp_path):
    lg = JsonlLogger(JsonlLoggerConfig())
    lg.start(RunInfo(name="r", output_dir=tmp_path / "run", config={}))
    lg.log({"reward/mean": 0.25}, step=1)
    lg.log({"reward/mean": float("nan")}, step=2)
    lg.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.25 and rows[1]["reward/mean"] == "nan"
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # strict JSON


def test_read_metrics_leaves_out_a_last_line_cut_short_and_names_a_bad_one(tmp_path):
    """A run killed during a write (SIGKILL can end a file write at a page boundary) leaves half a
    line at the end: reading leaves it out; a bad line anywhere else is an error naming its line."""
    path = tmp_path / "metrics.jsonl"
    whole = [json.dumps({"step": s, "reward/mean": s / 10}) for s in (1, 2)]
    path.write_text("\n".join(whole) + "\n" + whole[1][:17])
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text("\n".join(whole) + "\n" + whole[1][:17] + "\n\n")  # the same, then blank lines
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text(whole[0] + "\n" + whole[1][:17] + "\n" + whole[1] + "\n")
    with pytest.raises(CoreRLError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(path)


def test_console_prints_key_metrics_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    lg = ConsoleLogger(ConsoleLoggerConfig(every_n_steps=2), stream=out)
    lg.start(RunInfo(name="r", output_dir=tmp_path, config={"trainer": {"total_steps": 3}}))
    for step in (1, 2, 3):
        lg.log({"reward/mean": step / 10, "actor/loss": 1.5, "other": 9.0}, step=step)
    lg.close()
    lines = out.getvalue().splitlines()
    assert lines == ["step 2/3 reward=0.2 loss=1.5", "step 3/3 reward=0.3 loss=1.5"]
