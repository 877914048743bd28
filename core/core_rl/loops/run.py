"""``train(cfg, host=...)``: a whole training run of the loop ``trainer.loop`` selects
(:func:`build_loop`): checked first (:mod:`core_rl.loops.preflight`), restarted after a crash as
``recover`` says (:func:`run_with_restarts`), and its summary printed (:func:`summary_lines`).

Automatic restarts (``recover.mode: auto`` with ``recover.retries``): in a single process,
:func:`run_with_restarts` catches an unexpected error (not a :class:`~core_rl.errors.CoreRLError`:
configuration errors, stops the configuration asks for and signals are not retried) or an inference
server that died mid-run (a :class:`~core_rl_server_kit.processes.ServerError` marked
``recoverable``: new servers start with the new trainer), closes the trainer, and builds a new one
that resumes from the newest valid checkpoint, at most ``retries`` times. Under ``torchrun`` a
failed rank leaves its process group unusable, so restarts are the launcher's: ``core-rl train
--nproc-per-node N`` restarts all workers (:mod:`core_rl.launch.local`), and each resumes the same way.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from typing import Any

from core_rl.checkpoint.resume import effective_recover_mode
from core_rl.config.epochs import derive_total_steps
from core_rl.config.schema import RunConfig
from core_rl.data.prompts import DataRow, prompt_count
from core_rl.errors import CoreRLError, PreflightError, warn
from core_rl.interfaces import TrainingLoop
from core_rl.launch.ranks import rank_and_world
from core_rl.loops.preflight import preflight
from core_rl.loops.signals import StopSignals
from core_rl.plugins.components import build_component
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import LOOP
from core_rl.rollout.replay import coverage_problems


def train(cfg: RunConfig, *, host: PluginHost) -> Mapping[str, Any]:
    """Check the data, model, machine and output directory (:mod:`core_rl.loops.preflight`), derive
    ``trainer.total_steps`` from ``trainer.total_epochs`` when set (:mod:`core_rl.config.epochs`),
    then build the loop ``trainer.loop`` selects and run it, restarting after a crash as ``recover``
    says (:func:`core_rl.loops.run.run_with_restarts`); rank 0 prints the run's summary
    (:func:`core_rl.loops.run.summary_lines`). Returns where the run's metrics, checkpoint and
    model are."""
    checked = preflight(cfg)
    # trainer.total_epochs: the steps follow from the prompts left after filtering (config/epochs.py)
    if cfg.trainer.total_epochs is not None:
        derive_total_steps(cfg, prompt_count(checked.rows, cfg.data, checked.tokenizer))
        if cfg.rollout.replay_from is not None and (missing := coverage_problems(cfg)):
            raise PreflightError(missing)
    result = run_with_restarts(cfg, host, data_rows=checked.rows)
    if rank_and_world()[0] == 0:
        print("\n".join(summary_lines(cfg, result)))
    return result


def build_loop(
    cfg: RunConfig, host: PluginHost, *, stop: StopSignals, data_rows: list[DataRow] | None = None
) -> TrainingLoop:
    """The loop of ``cfg.trainer.loop``, built by its factory with the loop's validated section
    (:func:`core_rl.plugins.components.build_component`)."""
    spec = cfg.trainer.loop
    entry = spec.entry if spec.entry is not None else host.get(LOOP, spec.name)
    return build_component(entry, cfg, host, stop=stop, data_rows=data_rows, config=spec.config)


def summary_lines(cfg: RunConfig, result: Mapping[str, Any]) -> list[str]:
    """What a finished run prints: where its metrics, checkpoint and model are, its last evaluation,
    and the peak memory of its steps (:meth:`core_rl.loops.memory.MemoryMeter.summary`; a loop may not report one)."""
    at_end = str(cfg.saver.at_end).lower()
    none = f"none saved (saver.every_n_steps={cfg.saver.every_n_steps}, saver.at_end={at_end})"
    lines = [f"metrics:    {result['metrics']}", f"checkpoint: {result['checkpoint'] or none}"]
    lines += [result["best_checkpoint"]] if result.get("best_checkpoint") else []  # saver.keep_best
    if result["export"] is not None:
        lines.append(f"model:      {result['export']}")
    lines += [result["evaluation"]] if result.get("evaluation") else []  # the last eval: (eval/evaluator.py)
    return lines + ([result["peak_memory"]] if result.get("peak_memory") else [])


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
    """Run the loop ``cfg`` selects (:func:`core_rl.loops.run.build_loop`) with SIGINT/SIGTERM
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
