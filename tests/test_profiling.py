"""``trainer.profile`` (core_rl.loops.profiling): the listed steps, and only they, leave a trace
and an operator table holding both the update and the embedded engine's generation (which runs in
its own thread); a step after the last is a configuration error naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core_rl.builtin.loggers import read_metrics
from core_rl.testing.faults import build_task, merged, run_dir
from fault_helpers import train_here, write_config

PROFILE_LABEL = pytest.importorskip("core_rl_hf.engine").PROFILE_LABEL


def test_the_listed_steps_are_profiled_in_every_thread(tmp_path: Path, host) -> None:
    base = build_task(tmp_path)
    config = merged(
        base,
        trainer={"total_steps": 3, "torch_threads": 1, "profile": {"steps": [2], "record_shapes": True}},
        saver={"every_n_steps": 0, "at_end": False, "export_hf": False},
    )
    train_here(config, host)
    run = run_dir(config)
    files = sorted(p.name for p in (run / "profile").iterdir())
    assert files == ["step2-rank0.json", "step2-rank0.txt"]  # no other step, no temporary file left

    trace = json.loads((run / "profile" / "step2-rank0.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = (PROFILE_LABEL, "aten::_fused_adamw_", "aten::searchsorted")
    threads = {name: {e["tid"] for e in events if e.get("name") == name} for name in names}
    # generation runs in the hf engine's worker thread, the optimizer in the trainer's: both recorded
    assert threads[PROFILE_LABEL] and threads["aten::_fused_adamw_"]
    assert threads[PROFILE_LABEL].isdisjoint(threads["aten::_fused_adamw_"])
    if not torch.cuda.is_available():  # on a GPU the sampling operators run inside a CUDA graph
        assert threads["aten::searchsorted"] and threads["aten::searchsorted"] <= threads[PROFILE_LABEL]

    table = (run / "profile" / "step2-rank0.txt").read_text()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"  # the update's device
    assert table.startswith(f"step 2, rank 0: operators by {sort}")
    assert "aten::mm" in table and "by input shape" in table

    rows = read_metrics(run / "metrics.jsonl")
    assert [r.get("profile/active") for r in rows] == [None, 1.0, None]


def test_no_profile_without_steps(tmp_path: Path, host) -> None:
    base = build_task(tmp_path)
    config = merged(base, trainer={"total_steps": 1, "torch_threads": 1}, saver={"every_n_steps": 0, "at_end": False})
    train_here(config, host)
    assert not (run_dir(config) / "profile").exists()


def test_a_step_after_the_last_is_a_config_error(tmp_path: Path, capsys) -> None:
    from core_rl import cli

    config = merged(build_task(tmp_path), trainer={"total_steps": 4, "profile": {"steps": [2, 7]}})
    path = write_config(config, tmp_path / "bad.yaml")
    assert cli.main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "trainer.profile.steps" in err and "[7]" in err and "trainer.total_steps=4" in err
    assert "Traceback" not in err
    assert cli.main(["config", "validate", str(path), "trainer.profile.steps=[0]"]) == 2
    assert "trainer.profile.steps" in capsys.readouterr().err


def test_a_large_profile_gets_its_table_from_the_raw_events(tmp_path: Path, host, monkeypatch) -> None:
    """Above ``FULL_TABLE_EVENTS`` (here every profile) torch's key_averages, minutes of Python for
    a GPU step of a real model, is not called: the table sums the raw events by name and device,
    each operator's calls counted (the step's matrix products among them)."""
    import core_rl.loops.profiling as profiling
    from torch.autograd.profiler import profile as autograd_profile

    monkeypatch.setattr(profiling, "FULL_TABLE_EVENTS", 0)

    def refused(*args, **kwargs):
        raise AssertionError("key_averages was called")

    monkeypatch.setattr(autograd_profile, "key_averages", refused)
    config = merged(
        build_task(tmp_path),
        # every row: on a GPU the kernels come first and would fill the default 40
        trainer={
            "total_steps": 2,
            "torch_threads": 1,
            "profile": {"steps": [2], "record_shapes": True, "row_limit": 10_000},
        },
        saver={"every_n_steps": 0, "at_end": False, "export_hf": False},
    )
    train_here(config, host)
    run = run_dir(config)
    lines = (run / "profile" / "step2-rank0.txt").read_text().splitlines()
    assert lines[0].startswith("step 2, rank 0: operators by total time (") and "raw events" in lines[0]
    assert lines[1].split() == ["name", "device", "calls", "total", "ms", "mean", "us"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    mm = rows["aten::mm"]
    assert mm[1] == "CPU" and int(mm[2]) > 0 and float(mm[3]) > 0
    assert json.loads((run / "profile" / "step2-rank0.json").read_text())["traceEvents"]  # the trace as before
