"""Building the components a training loop selects by name: one plugin section at a time, the
loggers (``jsonl`` always), and the quiet library progress bars every loop starts with."""

from __future__ import annotations

import os
import sys
from typing import Any

from core_rl.config.schema import PluginSpec, RunConfig
from core_rl.errors import stderr_line
from core_rl.interfaces import Logger
from core_rl.plugins.components import build_component
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import LOGGER, PluginKind


def build(host: PluginHost, kind: PluginKind, spec: PluginSpec) -> Any:
    """Build a component whose factory takes its validated section (``None`` without options),
    checked as :func:`core_rl.plugins.components.build_component` says."""
    return build_component(host.get(kind, spec.name), spec.config)


def build_loggers(cfg: RunConfig, host: PluginHost) -> list[Logger]:
    """The configured loggers, plus ``jsonl`` when absent: every run leaves its metrics file. Each
    is wrapped so that its per-step calls run under ``trainer.logger_timeout_s``
    (:class:`~core_rl.reliability.logger_deadline.DeadlineLogger`)."""
    from core_rl.reliability.logger_deadline import DeadlineLogger

    specs = list(cfg.loggers)
    if not any(s.name == "jsonl" for s in specs):
        specs.append(PluginSpec(name="jsonl", config=host.get(LOGGER, "jsonl").config_cls()))
    return [DeadlineLogger(build(host, LOGGER, s), cfg.trainer.logger_timeout_s) for s in specs]


def seed_process(cfg: RunConfig) -> None:
    """What a run sets in its process before building anything: ``trainer.torch_threads`` (when
    set; :func:`warn_of_busy_cores` when they need more cores than are free) and Python's and
    torch's RNGs seeded with ``experiment.seed``."""
    import random

    import torch

    if cfg.trainer.torch_threads:
        torch.set_num_threads(cfg.trainer.torch_threads)
    warn_of_busy_cores(cfg.trainer.torch_threads)
    random.seed(cfg.experiment.seed)
    torch.manual_seed(cfg.experiment.seed)


def warn_of_busy_cores(configured: int) -> None:
    """Print :func:`core_rl.loops.cpu_threads.thread_warning`'s line to stderr when torch's
    threads (``configured``: ``trainer.torch_threads``, 0 for torch's default), times the
    processes ``torchrun`` started on this node, need more cores than are free. Under ``torchrun``
    the node's first process (``LOCAL_RANK`` 0) alone prints it."""
    import torch

    from core_rl.loops.cpu_threads import cpu_budget, thread_warning

    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local_ranks = 1
    line = thread_warning(torch.get_num_threads(), configured, local_ranks, cpu_budget())
    if line is not None:
        stderr_line(line)


def quiet_library_progress_bars() -> None:
    """The console logger is the run's progress bar; silence the per-load bars of libraries.
    ``datasets`` is told through its environment variable unless a plugin imported it already:
    importing it only to switch its bars off cost about 86 MiB of resident memory per run."""
    import transformers

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    datasets = sys.modules.get("datasets")
    if datasets is not None:
        datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
