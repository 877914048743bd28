"""The memory figures of every step (core_rl.trainer.memory): the host's peak resident memory from
/proc, and per role the CUDA counters of its device (faked here: a CPU has none)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from core_rl.built_engines import BuiltEngine
from core_rl.config.schema import ActorConfig
from core_rl.trainer import memory
from core_rl.trainer.memory import HOST_KEY, MemoryMeter, host_peak_rss_bytes, reset_host_peak

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


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_the_host_peak_of_a_step_starts_from_the_reset():
    meter = MemoryMeter([])
    block = b"\x01" * (256 * 2**20)  # written, so resident during the first step
    del block
    first = meter.step_metrics()[HOST_KEY]
    second = meter.step_metrics()[HOST_KEY]
    assert first - second > 0.2  # GiB: the second step did not hold the block
    assert meter.peaks[HOST_KEY] == first
    assert meter.summary() == f"peak memory: host {first:.2f} GiB resident"


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
    monkeypatch.setattr(memory, "host_peak_rss_bytes", lambda: GIB)
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
    from core_rl.trainer.summary import summary_lines

    result = {"metrics": "m.jsonl", "checkpoint": "c", "export": None, "peak_memory": "peak memory: host 1.00 GiB"}
    assert summary_lines(RunConfig(), result) == ["metrics:    m.jsonl", "checkpoint: c", "peak memory: host 1.00 GiB"]
    del result["peak_memory"]  # a loop that does not report it
    assert summary_lines(RunConfig(), result)[-1] == "checkpoint: c"
