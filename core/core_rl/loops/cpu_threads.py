"""Whether the torch threads a run asks for fit the CPU it has: a one-line warning at start-up.

A torch thread that has no core to itself waits for one at every parallel region, and a decoding
step is hundreds of small ones: with ``trainer.torch_threads: 2`` on a 2-core machine that other
processes also kept busy, generation measured 8-18x slower than with one thread. The warning names
the cause before the run is slowed by it.

The figures (:func:`cpu_budget`):

- the cores the process may run on: its CPU affinity (``os.sched_getaffinity``), capped by the
  cgroup's CPU quota where one is set (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us``; the tightest over the process's cgroup and its ancestors);
- the load of other processes: the 1-minute load average, which counts runnable tasks on the whole
  machine, taken as the same share of the process's cores as of the machine's (on a machine of 64
  cores with 32 busy, half of a 2-core quota is taken as busy). It is read at start-up, before the
  run has kept any core busy for long, so it is mostly other processes' load;
- the threads asked for: ``trainer.torch_threads`` per process, or torch's own count where it is 0
  (torch's default: every core, or ``OMP_NUM_THREADS``), times the processes ``torchrun`` started
  on this node (``LOCAL_WORLD_SIZE``).

:func:`thread_warning` decides from them; it is pure, so a test can give it any machine.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import attrs

#: how many cores the threads may exceed the free ones by before the warning (the load average is
#: a decaying average: a fraction of a core either way is noise)
SLACK_CORES = 0.5


@attrs.frozen
class CpuBudget:
    """``cores``: what the process may use (affinity, cgroup quota); ``machine_cores``: the
    machine's (``os.cpu_count``); ``load``: the 1-minute load average (``None`` where unknown)."""

    cores: float
    machine_cores: int
    load: float | None


def _cpu_max_v2(text: str) -> float | None:
    """Cores allowed by a cgroup v2 ``cpu.max`` (``"150000 100000"`` -> 1.5; ``"max ..."``: none)."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return int(fields[0]) / int(fields[1])


def _cfs_v1(directory: Path) -> float | None:
    """Cores allowed by a cgroup v1 CPU controller directory (quota ``-1``: none)."""
    quota = int((directory / "cpu.cfs_quota_us").read_text())
    period = int((directory / "cpu.cfs_period_us").read_text())
    return quota / period if quota > 0 and period > 0 else None


def _ancestors(root: Path, cgroup: str) -> list[Path]:
    """``root/cgroup`` and each directory above it up to ``root`` (where they exist)."""
    parts = [p for p in cgroup.strip("/").split("/") if p]
    dirs = [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def cgroup_cpu_limit(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> float | None:
    """The cores the process's cgroup quota allows (the tightest over the cgroup and its
    ancestors, v2 or v1), ``None`` where no quota is set or none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            candidates = [(d, "cpu.max") for mount in (root, root / "unified") for d in _ancestors(mount, path)]
        elif "cpu" in controllers.split(","):
            mounts = [root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
            candidates = [(d, "cpu.cfs_quota_us") for mount in mounts for d in _ancestors(mount, path)]
        else:
            continue
        for directory, name in candidates:
            try:
                text = (directory / name).read_text()
                limit = _cpu_max_v2(text) if name == "cpu.max" else _cfs_v1(directory)
            except (OSError, ValueError):
                continue
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def cpu_budget() -> CpuBudget:
    """This process's :class:`CpuBudget`, read from the OS now."""
    machine = os.cpu_count() or 1
    try:
        cores: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this OS
        cores = machine
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, quota)
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return CpuBudget(cores=cores, machine_cores=machine, load=load)


def thread_warning(threads: int, configured: int, local_ranks: int, budget: CpuBudget) -> str | None:
    """The warning line when ``threads`` torch threads per process (``configured``:
    ``trainer.torch_threads``, 0 for torch's default) in each of ``local_ranks`` processes need
    more cores than are free, by more than :data:`SLACK_CORES`; ``None`` when they fit, or when
    each process has a single thread (there is no fewer to suggest)."""
    if threads <= 1:
        return None
    busy_share = 0.0 if budget.load is None else min(1.0, budget.load / max(budget.machine_cores, 1))
    free = budget.cores * (1.0 - busy_share)
    wanted = threads * max(local_ranks, 1)
    if wanted <= free + SLACK_CORES:
        return None
    fit = max(1, math.floor((free + SLACK_CORES) / max(local_ranks, 1)))
    setting = f"trainer.torch_threads: {configured}"
    if configured == 0:
        setting += f" (torch's default: {threads} threads)"
    if local_ranks > 1:
        setting += f" x {local_ranks} processes = {wanted} threads"
    cores = f"{budget.cores:g} core{'' if budget.cores == 1 else 's'}"
    load = "" if budget.load is None else f" (load average {budget.load:.2f} on {budget.machine_cores} cores)"
    return (
        f"core-rl: warning: {setting} on about {free:.1f} free of {cores}{load}: threads waiting for a "
        f"core slow generation and training several times; set trainer.torch_threads: {fit}"
    )
