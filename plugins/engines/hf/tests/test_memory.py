"""``core_rl_hf.memory.release_host_memory``: freed heap pages go back to the OS, at most once
per interval."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_rl_hf.memory import release_host_memory, trim_supported

pytestmark = pytest.mark.skipif(not trim_supported(), reason="needs glibc's malloc_trim")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_freed_heap_holes_are_returned_at_most_once_per_interval() -> None:
    # 64 KiB tensors come from the heap (below glibc's mmap threshold); freeing every other one
    # leaves holes the heap cannot shrink past, so they stay resident until trimmed
    blocks = [torch.ones(16 * 1024) for _ in range(4000)]  # ~250 MiB, touched
    del blocks[::2]
    before = _rss_mib()
    assert release_host_memory(min_interval_s=0.0)
    after = _rss_mib()
    assert before - after > 60, f"resident memory {before:.0f} -> {after:.0f} MiB"
    assert all(float(b[0]) == 1.0 for b in blocks[:10])  # what is still held is untouched
    more = [torch.ones(16 * 1024) for _ in range(2000)]
    del more[::2]
    held = _rss_mib()
    assert not release_host_memory(min_interval_s=3600.0)  # trimmed a moment ago: nothing done
    assert _rss_mib() > held - 20
