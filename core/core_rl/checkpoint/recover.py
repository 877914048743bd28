"""Automatic restarts after a crash (``recover.mode: auto`` with ``recover.retries``).

In a single process, :func:`run_with_restarts` catches an unexpected error (not a
:class:`~core_rl.errors.CoreRLError`: configuration errors, stops the configuration asks for and
signals are not retried) or an inference server that died mid-run (a
:class:`~core_rl_server_kit.processes.ServerError` marked ``recoverable``: new servers start with the new
trainer), closes the trainer, and builds a new one that resumes from the newest valid checkpoint,
at most ``retries`` times. Under ``torchrun`` a failed rank leaves its process group
unusable, so restarts are the launcher's: ``core-rl train --nproc-per-node N`` restarts all workers
(:mod:`core_rl.launch.local`), and each resumes the same way.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from typing import Any

from core_rl.checkpoint.resume import effective_recover_mode
from core_rl.config.schema import RunConfig
from core_rl.data.prompts import DataRow
from core_rl.errors import CoreRLError, warn
from core_rl.interfaces import TrainingLoop
from core_rl.loops.selection import build_loop
from core_rl.loops.signals import StopSignals
from core_rl.plugins.host import PluginHost


def under_launcher() -> bool:
    """Whether a torchrun-style launcher started this process (it then owns restarts)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def in_process_restarts(cfg: RunConfig) -> int:
    """How many times this process may restart the run after a crash."""
    if effective_recover_mode(cfg) != "auto" or under_launcher():
        return 0
    return cfg.recover.retries


def is_retriable(exc: BaseException) -> bool:
    """Whether a new trainer, resumed from the newest checkpoint, may succeed where ``exc`` ended
    the run: a bug or a crash, or a server that died (not one that cannot start or serve)."""
    if not isinstance(exc, Exception):
        return False
    return not isinstance(exc, CoreRLError) or bool(getattr(exc, "recoverable", False))


def run_with_restarts(cfg: RunConfig, host: PluginHost, *, data_rows: list[DataRow] | None = None) -> Mapping[str, Any]:
    """Run the loop ``cfg`` selects (:func:`core_rl.loops.selection.build_loop`) with SIGINT/SIGTERM
    handled (:class:`StopSignals`), restarting as the module
    docstring says; return the trainer's result. ``data_rows``: the checked rows of the data
    files (:func:`core_rl.loops.preflight.preflight`), reused by every restart."""
    if cfg.trainer.total_steps == 0:  # a caller that skipped core_rl.loops.train's derivation
        raise RuntimeError("trainer.total_steps is still to be derived from trainer.total_epochs (config/epochs.py)")
    restarts_left = in_process_restarts(cfg)
    announce = os.environ.get("RANK", "0") == "0"
    grace = cfg.trainer.stop_grace_s
    with StopSignals(announce=announce, grace_s=grace, run_dir=cfg.experiment.run_dir) as stop:
        while True:
            trainer: TrainingLoop | None = None
            try:
                trainer = build_loop(cfg, host, stop=stop, data_rows=data_rows)
                return trainer.run()
            except Exception as exc:
                if restarts_left <= 0 or not is_retriable(exc) or stop.requested:
                    raise
                restarts_left -= 1
                if not isinstance(exc, CoreRLError):  # its message says it all
                    traceback.print_exc()
                warn(
                    f"the run failed ({type(exc).__name__}: {exc}); restarting from the newest valid checkpoint "
                    f"(recover.retries: {restarts_left} restarts left)"
                )
            finally:
                if trainer is not None:
                    trainer.close()
