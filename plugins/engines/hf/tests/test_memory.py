"""``core_rl_hf.memory``: the ``reuse`` and ``release`` policies of ``rollout.engine.host_memory``."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from core_rl_hf.memory import release_host_memory, trim_supported

pytestmark = pytest.mark.skipif(not trim_supported(), reason="needs glibc's malloc_trim and mallopt")

#: each round allocates and touches four 20 MiB blocks and a few 64 KiB ones, as a step's
#: activations, frees them, and, under ``release``, trims as the engine does around a generation
_ROUNDS = """
import json, resource, sys
import torch
from core_rl_hf import memory

policy = sys.argv[1]
applied = memory.keep_freed_memory() if policy == "reuse" else None
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    big = [torch.ones(5 * 1024 * 1024) for _ in range(4)]
    small = [torch.ones(16 * 1024) for _ in range(64)]
    del big, small
    if policy == "release":
        memory.release_host_memory(min_interval_s=0.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _rounds(policy: str) -> dict[str, object]:
    # a process of its own: the reuse settings are the whole process's, and stay
    done = subprocess.run([sys.executable, "-c", _ROUNDS, policy], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_reuse_keeps_freed_blocks_mapped_where_release_faults_them_in_again() -> None:
    reuse, release = _rounds("reuse"), _rounds("release")
    assert reuse["applied"] is True
    round_pages = 80 * 1024 * 1024 // resource.getpagesize()  # the faults count pages
    # medians: now and then a round's blocks do not fit the heap's free space as it lies and take
    # fresh pages at its top; after the first rounds, a round of reuse writes into pages it has
    assert statistics.median(reuse["faults"][2:]) < round_pages // 20, reuse["faults"]
    # release hands the blocks back each round: each round faults them in again
    assert statistics.median(release["faults"][1:]) > round_pages // 2, release["faults"]


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


@pytest.mark.parametrize(("policy", "resolved"), [("reuse", "reuse"), ("release", "release"), (None, "reuse")])
def test_the_engine_trims_around_a_generation_only_under_release(
    make_engine, monkeypatch, policy: str | None, resolved: str
) -> None:
    import core_rl_hf.engine as engine_module
    from core_rl.interfaces import SamplingParams

    calls: dict[str, int] = {"trim": 0, "keep": 0}
    monkeypatch.setattr(engine_module, "release_host_memory", lambda: calls.__setitem__("trim", calls["trim"] + 1))
    monkeypatch.setattr(engine_module, "keep_freed_memory", lambda: calls.__setitem__("keep", calls["keep"] + 1))
    engine = make_engine(host_memory=policy, device="cpu")  # null: reuse on a CPU
    assert engine.host_memory == resolved
    engine.generate([[3, 4, 5]], SamplingParams(n=2, max_new_tokens=3, temperature=1.0))
    assert calls == ({"trim": 0, "keep": 1} if resolved == "reuse" else {"trim": 2, "keep": 0})
