"""``trainer.profile``: ``torch.profiler`` around chosen trainer steps.

For each step listed in ``trainer.profile.steps``, every rank records the step's operators (CPU,
and CUDA where the run uses a GPU) in every thread of its process: the embedded rollout engine's
worker thread and the reward pool included, so generation shows up beside the update. It writes,
under ``<run>/profile/``:

- ``step<N>-rank<R>.json``: the Chrome/Perfetto trace (open it in ``chrome://tracing`` or
  https://ui.perfetto.dev);
- ``step<N>-rank<R>.txt``: the operator table (``key_averages``), sorted by self CPU time (self
  CUDA time on a GPU), ``row_limit`` rows; with ``record_shapes`` a second table groups by input
  shape.

Both are written through a temporary file and a rename, so a run killed while writing leaves no
half-written file. Operators run by inference servers (vLLM, SGLang) are in other processes and
are not recorded. The profiled step is slower than the others (the profiler's own cost, larger
with ``with_stack`` or ``profile_memory``); its ``timing/*`` metrics say so, and
``profile/active`` is 1 in its metrics row.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core_rl.checkpointing import write_text_atomic

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
        prof.export_chrome_trace(str(partial))
        os.replace(partial, trace)
        sort, rows = ("self_cuda_time_total" if cuda else "self_cpu_time_total"), self.config.row_limit
        tables = [f"step {step}, rank {self.rank}: operators by {sort}\n"]
        tables.append(prof.key_averages().table(sort_by=sort, row_limit=rows))
        if self.config.record_shapes:
            tables.append(f"\nby input shape (top {rows})\n")
            tables.append(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows))
        table = stem.with_suffix(".txt")
        write_text_atomic(table, "".join(tables))
        if self.rank == 0:
            print(f"core-rl: profile of step {step}: {trace} and {table}", file=sys.stderr, flush=True)
