"""The memory figures of every step (core_rl.loops.memory): the host's peak resident memory from
/proc, and per role the CUDA counters of its device (faked here: a CPU has none)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from core_rl.config.schema import ActorConfig
from core_rl.loops import memory
from core_rl.loops.memory import (
    HOST_KEY,
    HOST_NOW_KEY,
    MemoryMeter,
    host_memory_bytes,
    host_peak_rss_bytes,
    host_rss_bytes,
    reset_host_peak,
)
from core_rl.roles.built_engines import BuiltEngine
from max_rss import run_measured

GIB = 2**30


def test_host_peak_is_vmhwm(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  9999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert host_peak_rss_bytes(status) == 2048 * 1024


def test_host_peak_without_proc_is_the_rusage_peak(tmp_path):
    assert host_peak_rss_bytes(tmp_path / "missing") > 10 * 2**20  # a Python process with torch


def test_host_peak_is_reset_through_clear_refs(tmp_path):
    target = tmp_path / "clear_refs"
    assert reset_host_peak(target) and target.read_text() == "5"
    assert not reset_host_peak(tmp_path / "no" / "such" / "file")


def test_host_rss_is_vmrss(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert host_rss_bytes(status) == 1024 * 1024
    assert host_rss_bytes(tmp_path / "missing") is None


def test_peak_and_now_come_from_one_reading_and_now_never_exceeds_the_peak(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert host_memory_bytes(status) == (2048 * 1024, 1024 * 1024)
    # the kernel reports VmHWM >= VmRSS in one reading; a status that does not is clamped
    status.write_text("Name:\tpython\nVmHWM:\t  1024 kB\nVmRSS:\t  3072 kB\n")
    assert host_memory_bytes(status) == (3072 * 1024, 3072 * 1024)
    peak, now = host_memory_bytes(tmp_path / "missing")
    assert now is None and peak > 10 * 2**20  # the rusage peak


#: a process that holds a 768 MiB block during its first step only, then reads two steps' figures
#: and the run's summary, as a run does
TRANSIENT_PEAK = """
import json, sys
from core_rl.loops.memory import MemoryMeter
meter = MemoryMeter([])
block = bytearray(768 * 2**20)  # zero-filled: every page written, so resident
del block
first, second = meter.step_metrics(), meter.step_metrics()
json.dump({"first": first, "second": second, "summary": meter.summary()}, sys.stdout)
"""


def _run_measured(code: str, tmp_path: Path) -> tuple[dict, float]:
    """Run ``python -c code``; return what it printed (JSON) and its maximum resident set size as
    the OS reports it (:func:`max_rss.run_measured`), in GiB."""
    proc, os_peak = run_measured([sys.executable, "-c", code], tmp_path / "rusage.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), os_peak


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc only")
def test_the_host_peak_is_the_os_maximum_rss_and_keeps_an_earlier_steps_peak(tmp_path):
    shown, os_peak = _run_measured(TRANSIENT_PEAK, tmp_path)
    first, second = shown["first"], shown["second"]
    assert os_peak > 0.75  # GiB: the block was resident once
    # the peak since the process started: the first step's block is still in the second step's
    # figure and in the OS's record (resetting VmHWM after a step erased it from both)
    assert first[HOST_KEY] == second[HOST_KEY]
    assert abs(second[HOST_KEY] - os_peak) <= 0.1 * os_peak
    assert second[HOST_NOW_KEY] < second[HOST_KEY] - 0.5  # the block is gone by the step's end
    assert shown["summary"] == f"peak memory: host {second[HOST_KEY]:.2f} GiB resident"


#: a process without threads (no torch) that holds a 768 MiB block, then resets its peak
RESET_AFTER_PEAK = """
import json, sys
from core_rl.loops.memory import host_peak_rss_bytes, reset_host_peak
block = bytearray(768 * 2**20)
del block
before = host_peak_rss_bytes()
reset_host_peak()
json.dump({"before": before / 2**30, "after": host_peak_rss_bytes() / 2**30}, sys.stdout)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_a_reset_also_erases_the_os_record(tmp_path):
    """Why the meter never resets the host peak: the kernel's record at exit is the same counter
    (folded into the process's record only when a thread exits, so a process without threads
    shows it plainly)."""
    shown, os_peak = _run_measured(RESET_AFTER_PEAK, tmp_path)
    assert shown["before"] > 0.75 > 0.5 > shown["after"]
    assert os_peak < 0.5  # GiB: the 768 MiB block is not in the OS's maximum RSS either


class FakeCuda:
    """The CUDA peak counters of one device, as a step would leave them."""

    def __init__(self) -> None:
        self.allocated, self.reserved, self.resets = 0, 0, 0

    def reset_peak_memory_stats(self, device) -> None:
        self.resets += 1
        self.allocated = self.reserved = 0

    def max_memory_allocated(self, device) -> int:
        return self.allocated

    def max_memory_reserved(self, device) -> int:
        return self.reserved


def test_roles_on_one_device_report_its_peak_and_counters_reset_each_step(monkeypatch):
    fake = FakeCuda()
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: (GIB, GIB // 2))
    section = ActorConfig(model_path="m")
    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    built = [
        BuiltEngine("actor", section, cuda, True),
        BuiltEngine("ref", section, cuda, False),
        BuiltEngine("teacher", section, SimpleNamespace(device=torch.device("cpu")), False),
    ]
    meter = MemoryMeter(built)
    assert fake.resets == 1  # one device, reset before the first step
    fake.allocated, fake.reserved = 2 * GIB, 3 * GIB
    assert meter.step_metrics() == {
        HOST_KEY: 1.0,
        HOST_NOW_KEY: 0.5,
        "memory/actor/peak_gib": 2.0,
        "memory/actor/reserved_gib": 3.0,
        "memory/ref/peak_gib": 2.0,
        "memory/ref/reserved_gib": 3.0,
    }
    assert fake.resets == 2 and fake.allocated == 0
    fake.allocated, fake.reserved = GIB, GIB
    assert meter.step_metrics()["memory/actor/peak_gib"] == 1.0
    assert meter.summary() == (
        "peak memory: cuda:0 (actor, ref) 2.00 GiB allocated, 3.00 GiB reserved; host 1.00 GiB resident"
    )


def test_the_run_summary_ends_with_the_peak_memory():
    from core_rl.config.schema import RunConfig
    from core_rl.loops.run import summary_lines

    result = {"metrics": "m.jsonl", "checkpoint": "c", "export": None, "peak_memory": "peak memory: host 1.00 GiB"}
    assert summary_lines(RunConfig(), result) == ["metrics:    m.jsonl", "checkpoint: c", "peak memory: host 1.00 GiB"]
    del result["peak_memory"]  # a loop that does not report it
    assert summary_lines(RunConfig(), result)[-1] == "checkpoint: c"
