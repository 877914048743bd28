"""The run scaffold every built-in training loop shares (:class:`RunScaffold`): the RL loop
(:class:`~core_rl.loops.rl.loop.SyncTrainer`) and the supervised ones
(:class:`~core_rl.loops.supervised.loop.SupervisedLoop`) differ in what a step is and what they build.

The scaffold seeds the process, refuses a run directory that holds a run unless ``recover.mode``
continues it, builds the loop's components (its :meth:`RunScaffold._build`), then the ``auto``
micro-batch budgets (:mod:`core_rl.loops.auto_budget`) and the memory figures
(:mod:`core_rl.loops.memory`), the non-finite guard (:mod:`core_rl.loops.numerics`), the
profiler (:mod:`core_rl.loops.profiling`) and the checkpoint stage
(:class:`~core_rl.checkpoint.resume.CheckpointStage`). Its :meth:`RunScaffold.run`: resume as
``recover.mode`` says, record the config, start every logger (rank 0), then each step: the loop's
:meth:`~RunScaffold.step`, memory figures, evaluation and logging (rank 0), a checkpoint on the
saver's schedule or when a SIGINT/SIGTERM (:mod:`core_rl.loops.signals`) asks to stop, a
reference reset and a Hugging Face export when due; at the end the last checkpoint and the final
export, under the progress watchdog (:mod:`core_rl.reliability.watchdog`); a full disk becomes a
:class:`~core_rl.loops.errors.DiskFullError`. It returns where the run's results are.

A loop adds to it through a few methods, each a no-op here: :meth:`~RunScaffold._saved_state` and
:meth:`~RunScaffold._restore_state` (its part of a checkpoint), :meth:`~RunScaffold._evaluation`,
:meth:`~RunScaffold._eval_due`, :meth:`~RunScaffold._on_start`, :meth:`~RunScaffold._after_logged`,
:meth:`~RunScaffold._settle`, :meth:`~RunScaffold._trained_roles` and
:meth:`~RunScaffold._evaluation_summary`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core_rl.checkpoint.hf_exports import export_due, export_step
from core_rl.checkpoint.resume import CheckpointStage, effective_recover_mode
from core_rl.checkpoint.store import checkpoint_dir, is_disk_full
from core_rl.config.loader import to_plain
from core_rl.config.schema import RunConfig
from core_rl.data.balance import rank_rows
from core_rl.data.prompts import DataRow, PromptSource
from core_rl.errors import CoreRLError, stderr_line, warn
from core_rl.interfaces import Logger, RunInfo, TrainEngine, TrainingLoop
from core_rl.launch.ranks import agree_after, waiting_for
from core_rl.loops.auto_budget import resolve_auto_budgets
from core_rl.loops.building import quiet_library_progress_bars, seed_process
from core_rl.loops.errors import DiskFullError
from core_rl.loops.memory import MemoryMeter
from core_rl.loops.numerics import NonFiniteGuard
from core_rl.loops.profiling import StepProfiler
from core_rl.loops.rl.reference_reset import ReferenceReset
from core_rl.loops.run_config import record_config, resume_note
from core_rl.loops.run_progress import RunProgress
from core_rl.loops.signals import StopSignals
from core_rl.plugins.host import PluginHost
from core_rl.plugins.tally import PLUGIN_TALLY
from core_rl.protocol import TensorBatch
from core_rl.reliability.progress import PROGRESS
from core_rl.reliability.watchdog import Watchdog


class RunScaffold(TrainingLoop):
    """What every built-in loop's run has (see the module docstring). A subclass builds its models,
    tokenizer, :attr:`data`, :attr:`loggers`, :attr:`rank` and :attr:`world_size` in :meth:`_build`
    and says what a step is in :meth:`step`."""

    #: the actor's train engine, the frozen reference (``None``: none) and its reset
    engine: TrainEngine | None
    ref: TrainEngine | None
    reference_reset: ReferenceReset | None
    data: PromptSource
    rank: int
    world_size: int

    def __init__(
        self,
        cfg: RunConfig,
        host: PluginHost,
        *,
        stop: StopSignals | None = None,
        data_rows: list[DataRow] | None = None,
    ) -> None:
        """``data_rows``: the rows :func:`core_rl.loops.preflight.preflight` already read and checked
        (``None``: read ``data.train_files`` here)."""
        self.cfg = cfg
        self.host = host
        self._data_rows = data_rows
        #: the run's signal handlers (entered by :func:`core_rl.loops.run.train`); without them nothing asks to stop
        self.stop = stop if stop is not None else StopSignals(announce=False)
        seed_process(cfg)
        self.run_dir = cfg.experiment.run_dir
        self.recover_mode = effective_recover_mode(cfg)
        if self.recover_mode == "disabled" and (self.run_dir / "metrics.jsonl").exists():
            raise CoreRLError(
                f"run directory {self.run_dir} already holds a run; set recover.mode=auto (or trainer.resume=true) "
                "to continue it, or choose another experiment.name"
            )
        self.loggers: list[Logger] = []
        self.engine = None
        self.ref = None
        self.reference_reset = None
        self.built_engines: list[Any] = []  # for the auto micro-batch budgets and memory figures
        #: the run's step counters (the checkpoint stage writes them on a save and a resume)
        self.progress = RunProgress()
        PLUGIN_TALLY.take()  # counts from an earlier run in this process (a restart, a test) are not this one's
        try:
            self._build()
            resolve_auto_budgets(cfg, self.built_engines)  # once every model is on its device
            self.memory = MemoryMeter(self.built_engines)
        except BaseException:
            self.close()
            raise
        assert self.engine is not None
        self.nonfinite = NonFiniteGuard(self.run_dir, self.rank, cfg.trainer)
        self.profiler = StepProfiler(cfg.trainer.profile, self.run_dir, self.rank)
        self.checkpoints = CheckpointStage(
            cfg,
            self.progress,
            engine=self.engine,
            is_main=self.is_main,
            state=self._saved_state,
            restore=self._restore_state,
            roles=self._trained_roles(),
            reference_reset=self.reference_reset,
            settle=self._settle,
            stop=self.stop,
        )

    # -- what a loop provides -------------------------------------------------------------------

    @abstractmethod
    def _build(self) -> None:
        """Build the loop's components (:attr:`engine` into :attr:`built_engines`, :attr:`data`,
        :attr:`loggers` on rank 0, :attr:`rank`, :attr:`world_size`)."""

    @abstractmethod
    def step(self, step: int) -> dict[str, float]:
        """Run step ``step`` (1-based) and return its metrics (complete on rank 0)."""

    def _saved_state(self) -> dict[str, Any]:
        """The loop's part of a checkpoint (keys of :data:`core_rl.checkpoint.resume.STATE_KEYS`)."""
        difficulty = self.data.difficulty
        return {
            "data": self.data.state_dict(),
            "nonfinite": self.nonfinite.state_dict(),
            # data.difficulty_filter's records (loops/rl/difficulty.py), apart from the data position
            "difficulty": difficulty.state_dict() if difficulty is not None else {},
        }

    def _restore_state(self, extra: Mapping[str, Any], step: int) -> None:
        """Take back :meth:`_saved_state`'s part of a checkpoint of step ``step``."""
        self.data.load_state_dict(extra["data"])
        if self.data.difficulty is not None and (note := self.data.difficulty.load_state_dict(extra.get("difficulty"))):
            warn(note)
        self.nonfinite.load_state_dict(extra.get("nonfinite", {}))

    def _trained_roles(self) -> dict[str, TrainEngine]:
        """The trained roles besides the actor, saved in ``<checkpoint>/<role>`` (default: none)."""
        return {}

    def _settle(self) -> None:
        """Rank 0, before a checkpoint and after the last step: finish what runs behind the loop."""

    def _on_start(self) -> None:
        """Rank 0, before the loggers start (the resume step known)."""

    def _eval_due(self, step: int) -> bool:
        """Whether an evaluation follows step ``step`` (0: before the first; default: never)."""
        return False

    def _evaluation(self, step: int) -> dict[str, float]:
        """Rank 0: the evaluation's metrics after step ``step`` (0: before the first), if due."""
        return {}

    def _evaluation_summary(self) -> str | None:
        """The run summary's line of the last evaluation (``None``: none)."""
        return None

    def _after_logged(self, step: int) -> None:
        """Every rank, after step ``step`` is logged and before it is saved (a check that may stop the run)."""

    # -- shared parts ---------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def start_step(self) -> int:
        """The step this run continues after (0, or the resumed checkpoint's)."""
        return self.progress.start_step

    @property
    def completed_step(self) -> int:
        """The last step trained."""
        return self.progress.completed_step

    @property
    def last_saved(self) -> int | None:
        """The step of the newest checkpoint this run wrote or resumed from."""
        return self.progress.last_saved

    @property
    def resume_step(self) -> int | None:
        """The step a resumed run continues from (``None``: a fresh run)."""
        return self.progress.resume_step

    def save_checkpoint(self, step: int, metrics: Mapping[str, Any] | None = None) -> Path:
        """Save the state after step ``step`` (:meth:`CheckpointStage.save`)."""
        return self.checkpoints.save(step, metrics)

    def _load_tokenizer(self) -> None:
        """The actor's tokenizer (``actor.tokenizer_path``, else its model's) as :attr:`tokenizer`, and
        :attr:`pad_token_id`: its pad token, else its EOS token."""
        quiet_library_progress_bars()
        from transformers import AutoTokenizer

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.actor.tokenizer_path or cfg.actor.model_path, trust_remote_code=cfg.actor.trust_remote_code
        )
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id

    def _use_reference(self, ref: TrainEngine | None) -> None:
        """The reference engine a reset built (:mod:`core_rl.loops.rl.reference_reset`)."""
        self.ref = ref

    def _shard(self, batch: TensorBatch) -> TensorBatch:
        """This rank's rows of a global batch (:func:`core_rl.data.balance.rank_rows`)."""
        return batch.rows(rank_rows(batch, self.rank, self.world_size, self.cfg.actor.micro_batch.rank_assignment))

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train up to ``trainer.total_steps`` steps; return where the results are."""
        try:
            return self._run()
        except DiskFullError:
            raise
        except Exception as exc:
            if is_disk_full(exc):
                raise self.checkpoints.disk_full(f"({exc})") from exc
            raise

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.checkpoints.maybe_resume()
        if self.reference_reset is not None:
            self._use_reference(self.reference_reset.restore(self.start_step, self.ref))
        info = RunInfo(
            name=cfg.experiment.name, output_dir=self.run_dir, config=to_plain(cfg), resume_step=self.resume_step
        )
        error: Exception | None = None
        started: list[Logger] = []
        if self.is_main:
            try:
                note = resume_note(record_config(self.run_dir, cfg, self.resume_step, host=self.host), self.resume_step)
                if note:
                    stderr_line(f"core-rl: note: {note}")
                self._on_start()
                for lg in self.loggers:
                    lg.start(info)
                    started.append(lg)
                if evaluated := self._evaluation(0):  # eval.before_train: the starting policy, at step 0
                    for lg in self.loggers:
                        lg.log(evaluated, 0)
            except Exception as exc:
                error = exc
        try:
            what = "starting the loggers" + (" and evaluating the starting policy" if self._eval_due(0) else "")
            stop = agree_after(f"{what} (rank 0)", error, self.stop.requested)
            if stop:
                raise self.checkpoints.interrupted(stop)
            with self._watchdog():
                export = self._steps()
        finally:
            for lg in started:
                lg.close()
        last = checkpoint_dir(self.run_dir, self.last_saved) if self.last_saved else None
        best = self.checkpoints.best_checkpoints
        return {
            "best_checkpoint": best.best_line(self.run_dir) if best and self.is_main else None,
            "run_dir": self.run_dir,
            "metrics": self.run_dir / "metrics.jsonl",
            "checkpoint": last,
            "export": export,
            "peak_memory": self.memory.summary(),
            "evaluation": self._evaluation_summary(),
        }

    def _watchdog(self) -> Watchdog:
        """This process's progress watchdog over the steps (:mod:`core_rl.reliability.watchdog`)."""
        return Watchdog(
            self.cfg.trainer.watchdog, self.run_dir, rank=self.rank, world_size=self.world_size, stop=self.stop
        )

    def _steps(self) -> Path | None:
        """The loop's steps from :attr:`start_step`, then the final save and export; the final
        export's directory (``None``: none)."""
        assert self.engine is not None
        cfg = self.cfg
        try:
            metrics = self._each_step()
        finally:
            PROGRESS.end_loop()
        if self.is_main:  # e.g. the last version's load: its error belongs to this run
            self._settle()
        if cfg.saver.at_end and self.last_saved != self.completed_step:
            self.checkpoints.save(self.completed_step, metrics if self.is_main else None)
        export = None
        if cfg.saver.export_hf:
            export = self.run_dir / "final_hf"
            with PROGRESS.phase("export"), waiting_for("the other ranks to export the final model"):
                self.engine.export_hf(export)
        return export

    def _each_step(self) -> dict[str, Any]:
        """Steps :attr:`start_step` + 1 to ``trainer.total_steps`` (each timed for the watchdog,
        :mod:`core_rl.reliability.progress`); the last one's metrics."""
        metrics: dict[str, Any] = {}
        for step in range(self.start_step + 1, self.cfg.trainer.total_steps + 1):
            PROGRESS.begin_step(step)
            with self.profiler.around(step):
                metrics = self.step(step)
            metrics.update(self.memory.step_metrics())  # loops/memory.py
            if self.profiler.wants(step):
                metrics = {**metrics, "profile/active": 1.0}
            self.progress.completed_step = step
            stop = self._evaluate_and_log(step, metrics)
            self._after_logged(step)
            self._finish_step(step, metrics, stop)
        return metrics

    def _evaluate_and_log(self, step: int, metrics: dict[str, Any]) -> str | None:
        """Rank 0: the step's evaluation into ``metrics``, then ``metrics`` to every logger; every
        rank: the signal that asks to stop, if any (agreed on by every rank)."""
        error = None
        if self.is_main:
            try:
                metrics.update(self._evaluation(step))
                with PROGRESS.phase("logging"):
                    for lg in self.loggers:
                        lg.log(metrics, step)
            except Exception as exc:
                error = exc
        return agree_after(f"step {step}", error, self.stop.requested)

    def _finish_step(self, step: int, metrics: dict[str, Any], stop: str | None) -> None:
        """After step ``step`` is logged: the reference reset, the checkpoint (when due or asked to
        stop), the Hugging Face export when due; then the stop, if asked for."""
        assert self.engine is not None
        if self.reference_reset is not None:  # before the checkpoint, which may need its export
            self._use_reference(self.reference_reset.after_step(step, self.engine, self.ref))
        if self.checkpoints.due(step) or stop:
            self.checkpoints.save(step, metrics if self.is_main else None)
        if export_due(self.cfg.saver, step):
            with PROGRESS.phase("export"):
                export_step(self.engine, self.cfg.saver, self.run_dir, step, is_main=self.is_main)
        if stop:
            raise self.checkpoints.interrupted(stop)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.ref = self.engine = None
