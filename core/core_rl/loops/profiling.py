"""``trainer.profile``: ``torch.profiler`` around chosen trainer steps.

For each step listed in ``trainer.profile.steps``, every rank records the step's operators (CPU,
and CUDA where the run uses a GPU) in every thread of its process: the embedded rollout engine's
worker thread and the reward pool included, so generation shows up beside the update. It writes,
under ``<run>/profile/``:

- ``step<N>-rank<R>.json``: the Chrome/Perfetto trace (open it in ``chrome://tracing`` or
  https://ui.perfetto.dev);
- ``step<N>-rank<R>.txt``: the operator table (``key_averages``), sorted by self CPU time (self
  CUDA time on a GPU), ``row_limit`` rows; with ``record_shapes`` a second table groups by input
  shape. Above :data:`FULL_TABLE_EVENTS` recorded events (a GPU step of a real model: CUPTI
  records every kernel of every CUDA-graph replay) torch's tables would take minutes of Python, so
  the table sums the raw events by name and device instead (:func:`raw_table`).

Both are written through a temporary file and a rename, so a run killed while writing leaves no
half-written file. Operators run by inference servers (vLLM, SGLang) are in other processes and
are not recorded. The profiled step is slower than the others (the profiler's own cost, larger
with ``with_stack`` or ``profile_memory``); its ``timing/*`` metrics say so, and
``profile/active`` is 1 in its metrics row.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core_rl.checkpoint.atomic import write_text_atomic
from core_rl.errors import stderr_line

if TYPE_CHECKING:
    from core_rl.config.schema import ProfileConfig


def profile_dir(run_dir: Path) -> Path:
    return run_dir / "profile"


def _all_threads_config() -> object | None:
    """Kineto's experimental option to record every thread of the process, where this torch has it; else None."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


class StepProfiler:
    """Profiles the steps ``config.steps`` of one rank (see the module docstring)."""

    def __init__(self, config: ProfileConfig, run_dir: Path, rank: int) -> None:
        self.config = config
        self.directory = profile_dir(run_dir)
        self.rank = rank
        self.steps = frozenset(config.steps)

    def wants(self, step: int) -> bool:
        return step in self.steps

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """Profile the body when ``step`` is one of ``trainer.profile.steps``; otherwise nothing."""
        if not self.wants(step):
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        options: dict[str, object] = {}
        threads = _all_threads_config()
        if threads is not None:
            options["experimental_config"] = threads
        c = self.config
        with profile(
            activities=activities,
            record_shapes=c.record_shapes,
            with_stack=c.with_stack,
            profile_memory=c.profile_memory,
            **options,
        ) as prof:
            yield
        self._write(step, prof, cuda=ProfilerActivity.CUDA in activities)

    def _write(self, step: int, prof: torch.profiler.profile, *, cuda: bool) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = self.directory / f"step{step}-rank{self.rank}"
        trace = stem.with_suffix(".json")
        partial = trace.with_name(f".{trace.name}.{os.getpid()}.tmp")
        start = time.perf_counter()
        prof.export_chrome_trace(str(partial))
        os.replace(partial, trace)
        exported = time.perf_counter()
        events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
        sort, rows = ("self_cuda_time_total" if cuda else "self_cpu_time_total"), self.config.row_limit
        if len(events) > FULL_TABLE_EVENTS:  # key_averages would take minutes: totals from the raw events
            tables = [raw_table(events, f"step {step}, rank {self.rank}", cuda=cuda, rows=rows)]
        else:
            tables = [f"step {step}, rank {self.rank}: operators by {sort}\n"]
            tables.append(prof.key_averages().table(sort_by=sort, row_limit=rows))
            if self.config.record_shapes:
                tables.append(f"\nby input shape (top {rows})\n")
                tables.append(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows))
        table = stem.with_suffix(".txt")
        write_text_atomic(table, "".join(tables))
        if self.rank == 0:
            stderr_line(
                f"core-rl: profile of step {step}: {trace} and {table} ({len(events)} events; trace written in "
                f"{exported - start:.1f} s, table in {time.perf_counter() - exported:.1f} s)"
            )


#: above this many recorded events the operator table sums Kineto's raw events (about 4 us each)
#: instead of torch's ``key_averages`` (70 us each and more with CUDA: a profiled GPU step of a
#: 0.36B model records some 300,000, minutes of Python after the step)
FULL_TABLE_EVENTS = 100_000


def raw_table(events: Sequence[Any], title: str, *, cuda: bool, rows: int) -> str:
    """The ``rows`` operators and kernels with the most time, totals by name and device over
    Kineto's ``events`` (inclusive times: an operator's include its children's; a kernel's are its
    own), GPU kernels first on a GPU."""
    totals: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for event in events:
        entry = totals[(event.name(), str(event.device_type()).removeprefix("DeviceType."))]
        entry[0] += 1
        entry[1] += event.duration_ns()
    first = "CUDA" if cuda else "CPU"
    ranked = sorted(totals.items(), key=lambda kv: (kv[0][1] != first, -kv[1][1]))[:rows]
    width = max([len(name) for (name, _), _ in ranked] + [4])
    lines = [
        f"{title}: operators by total time ({len(events)} events: totals of the raw events, inclusive; "
        f"torch's key_averages tables above {FULL_TABLE_EVENTS} events are skipped for their cost)",
        f"{'name':<{width}}  {'device':<6}{'calls':>10}{'total ms':>12}{'mean us':>10}",
    ]
    for (name, device), (calls, nanos) in ranked:
        lines.append(f"{name:<{width}}  {device:<6}{calls:>10}{nanos / 1e6:>12.3f}{nanos / calls / 1e3:>10.1f}")
    return "\n".join(lines) + "\n"
