"""Checkpoints of a training loop: saving after a step (atomically, pruned to ``saver.keep_last``),
choosing the checkpoint to resume from as ``recover.mode`` says, restoring every piece of state the
loop keeps, and the messages of a full disk and of a run stopped by a signal.

:class:`Checkpointing` is the part of :class:`~core_rl.trainer.sync.SyncTrainer` (and so of every
loop built on it) that does this; the files themselves are :mod:`core_rl.trainer.checkpoints`'.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core_rl.checkpointing import discard_partial
from core_rl.config.schema import RunConfig
from core_rl.errors import CoreRLError
from core_rl.interfaces import AdvantageEstimator, RolloutEngine, TrainEngine
from core_rl.progress import PROGRESS
from core_rl.trainer import checkpoints
from core_rl.trainer.checkpoint_policy import BestCheckpoints, TimedSaves
from core_rl.trainer.critic import CRITIC_DIR, check_role_states, load_role_states, save_role_states
from core_rl.trainer.data import PromptSource
from core_rl.trainer.errors import DiskFullError, RunFailed, TrainingInterrupted
from core_rl.trainer.filtering import EmptySteps
from core_rl.trainer.numerics import NonFiniteGuard
from core_rl.trainer.ranks import broadcast_outcome, waiting_for
from core_rl.trainer.rewards import RewardErrorLog
from core_rl.trainer.rollout_flow import RolloutFlow
from core_rl.trainer.weight_load import BackgroundWeightLoad

if TYPE_CHECKING:
    from core_rl.trainer.reference_reset import ReferenceReset


def warn(message: str) -> None:
    """Print ``core-rl: warning: <message>`` on stderr."""
    print(f"core-rl: warning: {message}", file=sys.stderr, flush=True)


def effective_recover_mode(cfg: RunConfig) -> str:
    """``recover.mode``, with the older ``trainer.resume: true`` meaning ``auto``."""
    if cfg.recover.mode == "disabled" and cfg.trainer.resume:
        return "auto"
    return cfg.recover.mode


class Checkpointing:
    """Saving and resuming (see the module docstring). Collective where the engine's
    ``save_state`` / ``load_state`` are: every rank calls :meth:`save_checkpoint` and
    :meth:`maybe_resume`. :attr:`last_saved` is the step of the newest checkpoint this run wrote
    or resumed from, :attr:`completed_step` the last step trained."""

    cfg: RunConfig
    run_dir: Path
    recover_mode: str
    is_main: bool
    engine: TrainEngine | None
    rollout: RolloutEngine | None
    advantage: AdvantageEstimator | None
    reference_reset: ReferenceReset | None
    flow: RolloutFlow | None
    data: PromptSource
    nonfinite: NonFiniteGuard
    empty_steps: EmptySteps
    reward_log: RewardErrorLog
    weight_load: BackgroundWeightLoad
    best_checkpoints: BestCheckpoints | None
    timed_saves: TimedSaves
    start_step: int
    completed_step: int
    last_saved: int | None
    resume_step: int | None

    #: the loop's weight sync (:class:`core_rl.trainer.weight_sync.WeightSyncing`), after a resume
    _sync_weights: Callable[[int], dict[str, float]]

    def _trained_roles(self) -> dict[str, TrainEngine]:
        """The trained roles besides the actor, saved in ``<checkpoint>/<role>``."""
        roles = getattr(self, "roles", None)  # loops that build their own models have none
        return {CRITIC_DIR: roles.critic} if roles is not None and roles.critic is not None else {}

    def _extra_state(self, step: int) -> dict[str, Any]:
        """What the trainer adds to the engine's checkpoint (the main rank's copy is kept)."""
        return {
            "trainer_step": step,
            # the data position before the controller's first wave not yet trained on
            "data": self.flow.state_dict()["data"] if self.flow is not None else self.data.state_dict(),
            "controller": self.flow.state_dict() if self.flow is not None else {},
            "rollout": self.rollout.state_dict() if self.rollout is not None else {},
            "nonfinite": self.nonfinite.state_dict(),
            "empty_steps": self.empty_steps.state_dict(),
            "failed_steps": fs.state_dict() if (fs := getattr(self, "failed_steps", None)) is not None else {},
            "reward_errors": self.reward_log.state_dict(),
            "advantage": self.advantage.state_dict() if self.advantage is not None else {},
            "loss": self.loss.state_dict() if getattr(self, "loss", None) is not None else {},
            "ptx": ptx.state_dict() if (ptx := getattr(getattr(self, "update", None), "ptx", None)) else {},
            # the run's count of zero-signal updates (trainer/update.py)
            "zero_signal": (
                zero.state_dict() if (zero := getattr(getattr(self, "update", None), "zero_signal", None)) else {}
            ),
            # algorithm.mismatch_budget's count and correction (trainer/mismatch_budget.py)
            "mismatch_budget": budget.state_dict() if (budget := getattr(self, "mismatch_budget", None)) else {},
            # data.difficulty_filter's records (trainer/difficulty.py), apart from the data position
            "difficulty": self.data.difficulty.state_dict() if self.data.difficulty is not None else {},
        }

    def save_checkpoint(self, step: int, metrics: Mapping[str, Any] | None = None) -> Path:
        """Save the state after step ``step`` (the step just completed: never another name);
        ``metrics`` (rank 0: those logged at ``step``) score it for ``saver.keep_best``. The
        ``checkpoint`` phase of the step (:mod:`core_rl.progress`)."""
        with PROGRESS.phase("checkpoint", checkpoints.checkpoint_dir(self.run_dir, step).name):
            return self._save_checkpoint(step, metrics)

    def _save_checkpoint(self, step: int, metrics: Mapping[str, Any] | None) -> Path:
        assert self.engine is not None
        if step != self.completed_step:
            raise RuntimeError(f"checkpoint of step {step} asked for after step {self.completed_step}")
        path = checkpoints.checkpoint_dir(self.run_dir, step)
        if self.is_main:  # the rollout engine's state is saved too: its load must be done
            self.weight_load.wait()
        try:
            with waiting_for(f"the other ranks to save checkpoint {path.name}"):
                optimizer = self.cfg.saver.save_optimizer
                self.engine.save_state(path, self._extra_state(step), optimizer=optimizer)
                save_role_states(self._trained_roles(), path, optimizer=optimizer)
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
                raise self._disk_full(f"while saving checkpoint {path} (its partial files were removed)") from exc
            raise
        self.last_saved = step
        self.timed_saves.saved()
        return path

    def _disk_full(self, what: str) -> DiskFullError:
        newest = checkpoints.latest_checkpoint(self.run_dir)
        return DiskFullError(
            f"no space left on device {what}; the newest valid checkpoint is {newest or 'none (nothing saved yet)'}. "
            "Free space (or lower saver.keep_last) and resume with recover.mode=auto"
        )

    def _check_checkpoint(self, path: Path) -> None:
        assert self.engine is not None
        self.engine.check_checkpoint(path)
        check_role_states(self._trained_roles(), path)

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
        assert self.engine is not None
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
        self.resume_step = 0
        if path is None:
            return
        optimizer = self.cfg.recover.load_optimizer
        with waiting_for(f"the other ranks to load checkpoint {path.name}"):
            extra = self.engine.load_state(path, optimizer=optimizer)
            load_role_states(self._trained_roles(), path, optimizer=optimizer)
        step = int(extra["trainer_step"])
        if step != checkpoints.step_of(path):
            raise RunFailed(f"checkpoint {path} holds the state after step {step}, not {checkpoints.step_of(path)}")
        self.start_step = self.completed_step = self.resume_step = step
        self.last_saved = step
        self.data.load_state_dict(extra["data"])
        if self.data.difficulty is not None and (note := self.data.difficulty.load_state_dict(extra.get("difficulty"))):
            warn(note)
        if self.flow is not None:
            self.flow.load_state_dict(extra.get("controller", {}), step)
        if self.rollout is not None:
            self.rollout.load_state_dict(extra.get("rollout", {}))
        self.nonfinite.load_state_dict(extra.get("nonfinite", {}))
        self.empty_steps.load_state_dict(extra.get("empty_steps", {}))
        if (failed_steps := getattr(self, "failed_steps", None)) is not None:
            failed_steps.load_state_dict(extra.get("failed_steps", {}))
        self.reward_log.load_state_dict(extra.get("reward_errors", {}))
        if self.advantage is not None:
            self.advantage.load_state_dict(extra.get("advantage", {}))
        if getattr(self, "loss", None) is not None:  # loops without a policy loss have none
            self.loss.load_state_dict(extra.get("loss", {}))
        if (ptx := getattr(getattr(self, "update", None), "ptx", None)) is not None:
            ptx.load_state_dict(extra.get("ptx", {}))
        if (zero := getattr(getattr(self, "update", None), "zero_signal", None)) is not None:
            zero.load_state_dict(extra.get("zero_signal", {}))
        if (budget := getattr(self, "mismatch_budget", None)) is not None:
            budget.load_state_dict(extra.get("mismatch_budget", {}))
        with waiting_for("the other ranks to send the resumed weights to the rollout engine"):
            self._sync_weights(step)
        if self.is_main:
            print(f"core-rl: resumed from {path} (step {step})", file=sys.stderr, flush=True)
            if not optimizer:
                warn(
                    f"recover.load_optimizer is false: the weights, step, data position, schedule and RNG of "
                    f"{path.name} were restored, and the optimizer starts fresh"
                )

    def _interrupted(self, signal_name: str) -> TrainingInterrupted:
        where = checkpoints.checkpoint_dir(self.run_dir, self.last_saved) if self.last_saved else None
        saved = f"checkpoint {where}" if where else "nothing to save yet"
        total = self.cfg.trainer.total_steps
        message = f"stopped by {signal_name} after step {self.completed_step} of {total}; {saved}"
        stop = getattr(self, "stop", None)  # the run's signal handlers: past their grace period only closing is left
        if stop is not None:
            stop.saved(message)
        return TrainingInterrupted(f"{message}. Continue the run with recover.mode=auto (or trainer.resume=true)")
