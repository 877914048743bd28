"""Memory figures of every step, and their peaks over the run.

Each step logs, for the process, on a CPU as on a GPU:

- ``memory/host_peak_rss_gib``: the process's peak resident memory since it started, in GiB
  (2**30 bytes): ``VmHWM`` in ``/proc/self/status`` (where that is not available, ``getrusage``'s
  ``ru_maxrss``). That is the kernel's record of the process's peak, which the OS reports as its
  maximum resident set size (``getrusage``, ``wait4``, ``/usr/bin/time -v``'s "Maximum resident
  set size", in KiB), so it never falls from one step to the next. It is never reset: writing
  ``5`` to ``/proc/self/clear_refs`` restarts ``VmHWM`` from the current resident memory, and the
  kernel's record with it, so the OS would report only the peak since the last reset;
- ``memory/host_rss_gib``: the process's resident memory at the step's end (``VmRSS``), what it
  still holds after the step: the figure that shows growth from step to step.

Both count every page the process has resident: anonymous memory (tensors, the optimizer's state,
Python objects) and mapped files (the ``safetensors`` weights while mapped, the shared libraries of
torch and its kin). They are per process: child processes (a rollout server, a reward worker) and
the other ranks' processes are not included. Read from outside, the OS's figure for a process also
counts the copy of its parent that ``exec`` replaced: a run spawned directly by a Python process
that has imported torch reports at least that process's memory; ``/usr/bin/time``, a small parent,
reports the run's own.

And per role whose engine computes on a CUDA device (:mod:`core_rl.roles.built_engines`):

- ``memory/<role>/peak_gib``: the most memory torch had allocated on that device during the step
  (``torch.cuda.max_memory_allocated``, reset after each step);
- ``memory/<role>/reserved_gib``: the most torch's caching allocator held from the driver during the
  step (``torch.cuda.max_memory_reserved``): allocated memory plus cached blocks, what other
  processes cannot use.

The CUDA counters are per device and per process, not per model: roles that share a device (an
actor and its reference on ``cuda:0``, and the embedded rollout engine beside them) report the same
figure, the peak of everything on that device.

Under ``torchrun`` each figure is the largest over the ranks (the OS's maximum resident set size of
the largest rank process; the ranks of one node together hold up to ``nproc_per_node`` times it).
:meth:`MemoryMeter.summary` is the line the run prints at its end: each device figure's peak over
the run's steps, and the host's peak resident memory, which also counts the checkpoint and export
after the last step. ``docs/memory.md`` breaks the figures of a real model down.
"""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core_rl.launch.ranks import rank_and_world, waiting_for
from core_rl.roles.built_engines import BuiltEngine

GIB = 2**30
HOST_KEY = "memory/host_peak_rss_gib"
HOST_NOW_KEY = "memory/host_rss_gib"
_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)
_RSS = re.compile(r"^VmRSS:\s+(\d+)\s+kB", re.MULTILINE)


def host_memory_bytes(status: Path = Path("/proc/self/status")) -> tuple[int, int | None]:
    """``(peak, now)`` from one reading of ``status`` (Linux), so that ``now <= peak`` holds even while
    other threads allocate (two readings a moment apart can see the resident memory above the peak
    read first). ``peak``: since the process started (or since the last :func:`reset_host_peak`),
    ``VmHWM``, else ``ru_maxrss`` (KiB on Linux, bytes on macOS), at least ``now``; ``now``:
    ``VmRSS``, ``None`` without it."""
    try:
        text = status.read_text()
    except OSError:
        text = ""
    hwm, rss = _HWM.search(text), _RSS.search(text)
    now = int(rss.group(1)) * 1024 if rss else None
    if hwm:
        peak = int(hwm.group(1)) * 1024
    else:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    return (peak if now is None else max(peak, now)), now


def host_peak_rss_bytes(status: Path = Path("/proc/self/status")) -> int:
    """The process's peak resident memory: the ``peak`` of :func:`host_memory_bytes`."""
    return host_memory_bytes(status)[0]


def host_rss_bytes(status: Path = Path("/proc/self/status")) -> int | None:
    """The process's resident memory now: the ``now`` of :func:`host_memory_bytes`."""
    return host_memory_bytes(status)[1]


def reset_host_peak(clear_refs: Path = Path("/proc/self/clear_refs")) -> bool:
    """Start the peak resident memory again from the current one (Linux: ``5`` written to
    ``clear_refs``); ``False`` where that is not possible.

    For benchmarks that measure one part at a time: it also restarts the kernel's record, so the
    maximum resident set size the OS reports for the process afterwards (``getrusage``, ``wait4``,
    ``/usr/bin/time``) is only the peak since the last reset. A run never calls it."""
    try:
        clear_refs.write_text("5")
    except OSError:
        return False
    return True


class MemoryMeter:
    """Reads the step's memory figures (see the module docstring) for the roles of ``built``."""

    def __init__(self, built: Sequence[BuiltEngine]) -> None:
        #: role -> its CUDA device (roles off CUDA have no device figure)
        self.devices: dict[str, Any] = {}
        for b in built:
            if b.device.type == "cuda":
                self.devices.setdefault(b.role, b.device)
        #: the largest value of each figure over the steps read so far (rank 0's are over all ranks)
        self.peaks: dict[str, float] = {}
        self.reset()

    def reset(self) -> None:
        """Start the CUDA peak counters again (after a step, and before the first); the host's peak
        is the process's and is never reset."""
        import torch

        for device in set(self.devices.values()):
            torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> dict[str, float]:
        """This rank's figures (the CUDA ones since the last reset), in GiB."""
        import torch

        peak, now = host_memory_bytes()
        out = {HOST_KEY: peak / GIB}
        if now is not None:
            out[HOST_NOW_KEY] = now / GIB
        for role, device in self.devices.items():
            out[f"memory/{role}/peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            out[f"memory/{role}/reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        return out

    def step_metrics(self) -> dict[str, float]:
        """The step's figures (the largest over the ranks), then the CUDA counters reset; the run's
        peaks updated. Collective under ``torchrun``."""
        figures = self.read()
        _rank, world = rank_and_world()
        if world > 1:
            import torch.distributed as dist

            every: list[Any] = [None] * world
            with waiting_for("the other ranks' memory figures"):
                dist.all_gather_object(every, figures)
            figures = {k: max(f.get(k, 0.0) for f in every) for k in figures}
        self.reset()
        for key, value in figures.items():
            self.peaks[key] = max(self.peaks.get(key, 0.0), value)
        return figures

    def summary(self) -> str | None:
        """``peak memory: cuda:0 (actor, ref) 12.31 GiB allocated, 14.00 GiB reserved; host 3.52 GiB
        resident``: each device figure's peak over the run's steps, and the host's peak resident
        memory: the largest over the steps (and ranks), or this process's peak now where that is
        larger (a checkpoint or export after the last step). ``None`` before any step."""
        if not self.peaks:
            return None
        parts = []
        by_device: dict[str, list[str]] = {}
        for role, device in self.devices.items():
            by_device.setdefault(str(device), []).append(role)
        for device, roles in by_device.items():
            peak = max(self.peaks.get(f"memory/{r}/peak_gib", 0.0) for r in roles)
            reserved = max(self.peaks.get(f"memory/{r}/reserved_gib", 0.0) for r in roles)
            parts.append(f"{device} ({', '.join(roles)}) {peak:.2f} GiB allocated, {reserved:.2f} GiB reserved")
        host = max(self.peaks.get(HOST_KEY, 0.0), host_memory_bytes()[0] / GIB)
        parts.append(f"host {host:.2f} GiB resident")
        return "peak memory: " + "; ".join(parts)
