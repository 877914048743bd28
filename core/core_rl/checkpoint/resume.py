"""Checkpoints of a training loop: saving after a step (atomically, pruned to ``saver.keep_last``),
choosing the checkpoint to resume from as ``recover.mode`` says, restoring every piece of state the
loop keeps, and the messages of a full disk and of a run stopped by a signal.

:class:`CheckpointStage` is the stage of every loop (held by :class:`~core_rl.loops.scaffold.RunScaffold`)
that does this; the loop says what state it adds to the engine's (its ``state`` and ``restore``
callables); the files themselves are :mod:`core_rl.checkpoint.store`'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core_rl.checkpoint import store as checkpoints
from core_rl.checkpoint.files import discard_partial
from core_rl.checkpoint.policy import BestCheckpoints, TimedSaves
from core_rl.config.schema import RunConfig
from core_rl.errors import CoreRLError, stderr_line, warn
from core_rl.interfaces import TrainEngine
from core_rl.launch.ranks import broadcast_outcome, waiting_for
from core_rl.loops.errors import DiskFullError, RunFailed, TrainingInterrupted
from core_rl.loops.rl.critic import check_role_states, load_role_states, save_role_states
from core_rl.loops.run_progress import RunProgress
from core_rl.reliability.progress import PROGRESS

if TYPE_CHECKING:
    from core_rl.loops.rl.reference_reset import ReferenceReset
    from core_rl.loops.signals import StopSignals

#: the keys of the state a loop adds to the engine's checkpoint, in order (``{}`` where a loop has
#: no such part, so every loop's checkpoints hold the same keys)
STATE_KEYS = (
    "data",
    "controller",
    "rollout",
    "nonfinite",
    "empty_steps",
    "failed_steps",
    "reward_errors",
    "advantage",
    "loss",
    "ptx",
    "zero_signal",
    "mismatch_budget",
    "difficulty",
)


def effective_recover_mode(cfg: RunConfig) -> str:
    """``recover.mode``, with the older ``trainer.resume: true`` meaning ``auto``."""
    if cfg.recover.mode == "disabled" and cfg.trainer.resume:
        return "auto"
    return cfg.recover.mode


class CheckpointStage:
    """Saving and resuming (see the module docstring). Collective where the engine's
    ``save_state`` / ``load_state`` are: every rank calls :meth:`save` and :meth:`maybe_resume`.
    It writes the run's :class:`~core_rl.loops.run_progress.RunProgress`: ``last_saved`` on a
    save, every counter on a resume.

    ``state()``: the loop's part of a checkpoint (keys of :data:`STATE_KEYS`); ``restore(extra,
    step)``: the loop takes it back from a checkpoint's ``extra`` (after the engine's state, before
    the message saying it resumed); ``roles``: the trained roles besides the actor, saved in
    ``<checkpoint>/<role>``; ``settle``: what must be done before a save on the main rank (a weight
    load running behind); ``stop``: the run's signal handlers."""

    def __init__(
        self,
        cfg: RunConfig,
        progress: RunProgress,
        *,
        engine: TrainEngine,
        is_main: bool,
        state: Callable[[], Mapping[str, Any]],
        restore: Callable[[Mapping[str, Any], int], None],
        roles: Mapping[str, TrainEngine] | None = None,
        reference_reset: ReferenceReset | None = None,
        settle: Callable[[], object] | None = None,
        stop: StopSignals | None = None,
    ) -> None:
        self.cfg, self.progress, self.engine, self.is_main = cfg, progress, engine, is_main
        self.run_dir = cfg.experiment.run_dir
        self.recover_mode = effective_recover_mode(cfg)
        self.state, self.restore = state, restore
        self.roles = dict(roles or {})
        self.reference_reset, self.settle, self.stop = reference_reset, settle, stop
        #: saver.every_n_minutes and saver.keep_best (checkpoint/policy.py)
        self.timed_saves = TimedSaves(cfg.saver.every_n_minutes)
        keep_best = cfg.saver.keep_best
        self.best_checkpoints = BestCheckpoints(keep_best, self.run_dir) if keep_best.count else None

    def due(self, step: int) -> bool:
        """``saver.every_n_steps`` divides ``step``, or rank 0 finds ``saver.every_n_minutes``
        passed (sent to every rank, so they save together)."""
        every = self.cfg.saver.every_n_steps
        if every and step % every == 0:
            return True
        if not self.cfg.saver.every_n_minutes:
            return False
        return bool(broadcast_outcome(f"the checkpoint decision of step {step}", self.timed_saves.due(), None))

    def extra_state(self, step: int) -> dict[str, Any]:
        """What the trainer adds to the engine's checkpoint (the main rank's copy is kept)."""
        state = self.state()
        return {"trainer_step": step, **{key: state.get(key, {}) for key in STATE_KEYS}}

    def save(self, step: int, metrics: Mapping[str, Any] | None = None) -> Path:
        """Save the state after step ``step`` (the step just completed: never another name);
        ``metrics`` (rank 0: those logged at ``step``) score it for ``saver.keep_best``. The
        ``checkpoint`` phase of the step (:mod:`core_rl.reliability.progress`)."""
        with PROGRESS.phase("checkpoint", checkpoints.checkpoint_dir(self.run_dir, step).name):
            return self._save(step, metrics)

    def _save(self, step: int, metrics: Mapping[str, Any] | None) -> Path:
        if step != self.progress.completed_step:
            raise RuntimeError(f"checkpoint of step {step} asked for after step {self.progress.completed_step}")
        path = checkpoints.checkpoint_dir(self.run_dir, step)
        if self.is_main and self.settle is not None:  # e.g. a rollout engine's load must be done
            self.settle()
        try:
            with waiting_for(f"the other ranks to save checkpoint {path.name}"):
                optimizer = self.cfg.saver.save_optimizer
                self.engine.save_state(path, self.extra_state(step), optimizer=optimizer)
                save_role_states(self.roles, path, optimizer=optimizer)
            if self.is_main:
                checkpoints.mark_latest(self.run_dir, step)
                best = self.best_checkpoints
                if best is not None and metrics is not None:
                    best.record(step, metrics)
                keep = best.protected if best is not None else None
                checkpoints.prune(self.run_dir, self.cfg.saver.keep_last, keep)
                if self.reference_reset is not None:  # the references they need stay
                    self.reference_reset.prune(self.run_dir)
        except Exception as exc:
            if checkpoints.is_disk_full(exc):
                if self.is_main:
                    discard_partial(path)
                raise self.disk_full(f"while saving checkpoint {path} (its partial files were removed)") from exc
            raise
        self.progress.last_saved = step
        self.timed_saves.saved()
        return path

    def disk_full(self, what: str) -> DiskFullError:
        """The error of a full disk ``what`` (where it happened), naming the newest valid checkpoint."""
        newest = checkpoints.latest_checkpoint(self.run_dir)
        return DiskFullError(
            f"no space left on device {what}; the newest valid checkpoint is {newest or 'none (nothing saved yet)'}. "
            "Free space (or lower saver.keep_last) and resume with recover.mode=auto"
        )

    def _check_checkpoint(self, path: Path) -> None:
        self.engine.check_checkpoint(path)
        check_role_states(self.roles, path)

    def _choose_checkpoint(self) -> Path | None:
        """Rank 0: the checkpoint to resume from (``None``: start from the beginning), saying why
        it passed any over; refuses one beyond ``trainer.total_steps``."""
        found = checkpoints.find_resumable(self.run_dir, self._check_checkpoint)
        for note in found.notes:
            warn(note)
        checkpoints.remove_leftovers(self.run_dir)
        if found.path is None:
            if self.recover_mode == "resume":
                raise CoreRLError(
                    f"recover.mode=resume, but {checkpoints.checkpoints_root(self.run_dir)} holds no valid checkpoint; "
                    "use recover.mode=auto to start from the beginning when there is none"
                )
            return None
        total, epochs = self.cfg.trainer.total_steps, self.cfg.trainer.total_epochs
        if found.step > total:
            key = "trainer.total_steps" if epochs is None else "trainer.total_epochs"
            derived = "" if epochs is None else f" (derived from trainer.total_epochs={epochs} and the data)"
            raise CoreRLError(
                f"trainer.total_steps={total}{derived} is below the step of the checkpoint to resume from "
                f"({found.path}, step {found.step}); raise {key} to continue this run, or choose another "
                "experiment.name to start a new one"
            )
        return found.path

    def maybe_resume(self) -> None:
        """Continue from the newest valid checkpoint, as ``recover.mode`` says."""
        if self.recover_mode == "disabled":
            return
        chosen: Path | None = None
        error: Exception | None = None
        if self.is_main:
            try:
                chosen = self._choose_checkpoint()
            except Exception as exc:
                error = exc
        path = broadcast_outcome("the checkpoint to resume from", chosen, error)
        progress = self.progress
        progress.resume_step = 0
        if path is None:
            return
        optimizer = self.cfg.recover.load_optimizer
        with waiting_for(f"the other ranks to load checkpoint {path.name}"):
            extra = self.engine.load_state(path, optimizer=optimizer)
            load_role_states(self.roles, path, optimizer=optimizer)
        step = int(extra["trainer_step"])
        if step != checkpoints.step_of(path):
            raise RunFailed(f"checkpoint {path} holds the state after step {step}, not {checkpoints.step_of(path)}")
        progress.start_step = progress.completed_step = progress.resume_step = step
        progress.last_saved = step
        self.restore(extra, step)
        if self.is_main:
            stderr_line(f"core-rl: resumed from {path} (step {step})")
            if not optimizer:
                warn(
                    f"recover.load_optimizer is false: the weights, step, data position, schedule and RNG of "
                    f"{path.name} were restored, and the optimizer starts fresh"
                )

    def interrupted(self, signal_name: str) -> TrainingInterrupted:
        """The error ending a run stopped by ``signal_name`` after its last completed step."""
        last_saved = self.progress.last_saved
        where = checkpoints.checkpoint_dir(self.run_dir, last_saved) if last_saved else None
        saved = f"checkpoint {where}" if where else "nothing to save yet"
        total = self.cfg.trainer.total_steps
        message = f"stopped by {signal_name} after step {self.progress.completed_step} of {total}; {saved}"
        if self.stop is not None:  # the run's signal handlers: past their grace period only closing is left
            self.stop.saved(message)
        return TrainingInterrupted(f"{message}. Continue the run with recover.mode=auto (or trainer.resume=true)")
