"""The synchronous RL loop.

One step: prompts -> rollout (n samples each) -> rewards -> sample filters (drawing more prompt
batches while dynamic sampling asks for them) -> reward shaping, advantages and loss weights
(:mod:`core_rl.trainer.batching`) -> reference / recomputed log-probs and ``ppo_n_minibatches`` x
``ppo_epochs`` optimiser steps (:mod:`core_rl.trainer.update`) -> weights to the rollout engine ->
metrics to every logger -> checkpoint on the saver's schedule. With a ``reward_model:`` role the
reward model's scores, reward shaping and advantages come after the batch is sent, on every rank
(:mod:`core_rl.trainer.reward_role`).

Under ``torchrun`` every rank runs this loop with its own train-engine shard; rank 0 alone owns the
rollout engine, rewards and loggers, and broadcasts each step's batch to the other ranks; each rank
trains on the rows :func:`core_rl.engine_utils.packing.rank_rows` assigns it (token-balanced by
default). Every wait on another rank is bounded and a failure on one rank is sent to the others
(:mod:`core_rl.trainer.ranks`).

The loop's parts live beside it: building components (:mod:`core_rl.trainer.building`), what the
rewards and loggers see of samples (:mod:`core_rl.trainer.sample_log`), weight sync
(:mod:`core_rl.trainer.weight_sync`), saving and resuming (:mod:`core_rl.trainer.resume`), the ``auto``
micro-batch budgets chosen once the engines are built (:mod:`core_rl.trainer.auto_budget`), each
step's memory figures (:mod:`core_rl.trainer.memory`).

Faults: rewards run through :class:`~core_rl.trainer.rewards.RewardRunner` (timeouts, per-item
``on_error``); non-finite steps go through :class:`~core_rl.trainer.numerics.NonFiniteGuard`; a
SIGINT/SIGTERM (:mod:`core_rl.trainer.signals`) ends the loop after the current step with a
checkpoint; resuming picks the newest valid checkpoint (:mod:`core_rl.trainer.checkpoints`) and
restores every RNG the run uses, the data position, the rollout engine's state and the counters.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from core_rl.built_engines import BuiltEngine
from core_rl.config.epochs import derive_total_steps
from core_rl.config.loader import to_plain
from core_rl.config.reward_aggregation import combine_part_weights
from core_rl.config.schema import RunConfig
from core_rl.config.teacher_checks import model_vocab_size
from core_rl.engine_utils.packing import rank_rows
from core_rl.errors import ConfigError, CoreRLError, PreflightError
from core_rl.interfaces import (
    AdvantageEstimator,
    Logger,
    PolicyLoss,
    Reward,
    RolloutEngine,
    RunInfo,
    SampleFilter,
    TrainEngine,
    TrainingLoop,
)
from core_rl.kinds import (
    ADVANTAGE,
    POLICY_LOSS,
    REJECTION_SAMPLER,
    REWARD,
    SAMPLE_FILTER,
    WORKFLOW,
)
from core_rl.plugin_tally import PLUGIN_TALLY
from core_rl.plugins import PluginHost
from core_rl.preflight import preflight
from core_rl.progress import PROGRESS
from core_rl.protocol import RewardInput, TensorBatch
from core_rl.roles import build_engine, build_roles
from core_rl.trainer.auto_budget import resolve_auto_budgets
from core_rl.trainer.batching import BatchAssembler
from core_rl.trainer.building import build, build_loggers, quiet_library_progress_bars, seed_process
from core_rl.trainer.checkpoint_policy import BestCheckpoints, TimedSaves
from core_rl.trainer.checkpoints import checkpoint_dir, is_disk_full
from core_rl.trainer.colocated_memory import held_by_peer
from core_rl.trainer.colocation import RolloutSleep, build_rollout_engine, peer_rollout_sleep
from core_rl.trainer.critic import CriticStage
from core_rl.trainer.data import DataRow, PromptSource, prompt_count
from core_rl.trainer.distill import DistillationLoss, topk_of
from core_rl.trainer.errors import DiskFullError
from core_rl.trainer.evaluation import Evaluating, Evaluator, build_evaluator
from core_rl.trainer.failed_steps import FailedSteps
from core_rl.trainer.filtering import EmptySteps
from core_rl.trainer.hf_exports import export_due, export_step
from core_rl.trainer.memory import MemoryMeter
from core_rl.trainer.mismatch_budget import MismatchBudget
from core_rl.trainer.numerics import NonFiniteGuard
from core_rl.trainer.profiling import StepProfiler
from core_rl.trainer.ptx import PTXLoss, PTXRows
from core_rl.trainer.ranks import (
    agree_after,
    broadcast_outcome,
    rank_and_world,
    set_collective_timeout,
    waiting_for,
)
from core_rl.trainer.reference_reset import ReferenceReset
from core_rl.trainer.resume import Checkpointing, effective_recover_mode
from core_rl.trainer.reward_role import SCORES, NoRuleReward, reward_model_stage
from core_rl.trainer.rewards import RewardErrorLog, RewardRunner, ScoreResult
from core_rl.trainer.rollout_dump import RolloutDump
from core_rl.trainer.rollout_flow import RolloutFlow
from core_rl.trainer.rollout_replay import RolloutReplay, coverage_problems
from core_rl.trainer.rollout_scoring import RolloutScoring
from core_rl.trainer.run_config import record_config, resume_note
from core_rl.trainer.signals import StopSignals
from core_rl.trainer.summary import summary_lines
from core_rl.trainer.update import PolicyUpdate
from core_rl.trainer.watchdog import Watchdog
from core_rl.trainer.weight_load import BackgroundWeightLoad
from core_rl.trainer.weight_sync import WeightSyncing


class SyncTrainer(WeightSyncing, Evaluating, Checkpointing, RolloutScoring, TrainingLoop):
    """Builds every component a :class:`RunConfig` selects and runs the synchronous loop."""

    def __init__(
        self,
        cfg: RunConfig,
        host: PluginHost,
        *,
        stop: StopSignals | None = None,
        data_rows: list[DataRow] | None = None,
    ) -> None:
        """``data_rows``: the rows :func:`core_rl.preflight.preflight` already read and checked
        (``None``: read ``data.train_files`` here)."""
        self.cfg = cfg
        self.host = host
        self._data_rows = data_rows
        #: the run's signal handlers (entered by :func:`train`); without them nothing asks to stop
        self.stop = stop if stop is not None else StopSignals(announce=False)
        seed_process(cfg)
        self.run_dir = cfg.experiment.run_dir
        self.recover_mode = effective_recover_mode(cfg)
        if self.recover_mode == "disabled" and (self.run_dir / "metrics.jsonl").exists():
            raise CoreRLError(
                f"run directory {self.run_dir} already holds a run; set recover.mode=auto (or trainer.resume=true) "
                "to continue it, or choose another experiment.name"
            )
        self.rollout: RolloutEngine | None = None
        self.rollout_sleep = RolloutSleep()  # rank 0's is built with the engine (trainer/colocation.py)
        #: the advantage estimator (``None`` in loops that have none, e.g. the supervised ones)
        self.advantage: AdvantageEstimator | None = None
        self.reward: Reward | None = None
        self.reward_runner: RewardRunner | None = None
        self.loggers: list[Logger] = []
        self.evaluator: Evaluator | None = None  # rank 0's, with an eval: section (trainer/evaluation.py)
        self.ref: TrainEngine | None = None
        self.reference_reset: ReferenceReset | None = None
        self.engine: TrainEngine | None = None
        #: rank 0's rollout controller (:mod:`core_rl.trainer.rollout_flow`)
        self.flow: RolloutFlow | None = None
        #: rank 0's ``rollout.dump`` / ``rollout.replay_from`` (:mod:`core_rl.trainer.rollout_dump`, ``rollout_replay``)
        self.dump: RolloutDump | None = None
        self.replay: RolloutReplay | None = None
        #: steps the sample filters left with nothing to train on (:mod:`core_rl.trainer.filtering`)
        self.empty_steps = EmptySteps(cfg.algorithm.max_consecutive_empty_steps)
        #: steps whose every episode failed (:mod:`core_rl.trainer.failed_steps`)
        self.failed_steps = FailedSteps(cfg.algorithm.max_consecutive_failed_steps)
        PLUGIN_TALLY.take()  # counts from an earlier run in this process (a restart, a test) are not this one's
        #: rank 0's weight load running beside the trainer (asynchronous runs, disk sync)
        self.weight_load = BackgroundWeightLoad(
            cfg.rollout.controller.wait_timeout_s, "rollout.controller.wait_timeout_s"
        )
        self.built_engines: list[BuiltEngine] = []  # for the auto micro-batch budgets and memory figures
        try:
            self._build()
            resolve_auto_budgets(cfg, self.built_engines)  # once every model is on its device
            self.memory = MemoryMeter(self.built_engines)
        except BaseException:
            self.close()
            raise
        self.start_step = 0
        # (reward inputs, scores) of each generation batch of the current step, for sample logging
        self._scored_this_step: list[tuple[list[RewardInput], ScoreResult]] = []
        self.completed_step = 0
        self.last_saved: int | None = None
        #: saver.every_n_minutes and saver.keep_best (trainer/checkpoint_policy.py)
        self.timed_saves = TimedSaves(cfg.saver.every_n_minutes)
        keep_best = cfg.saver.keep_best
        self.best_checkpoints = BestCheckpoints(keep_best, self.run_dir) if keep_best.count else None
        #: the step a resumed run continues from (``None``: a fresh run; loggers then keep nothing)
        self.resume_step: int | None = None
        self.nonfinite = NonFiniteGuard(self.run_dir, self.rank, cfg.trainer)
        self.profiler = StepProfiler(cfg.trainer.profile, self.run_dir, self.rank)
        self.reward_log = RewardErrorLog(
            self.run_dir / "reward_errors.jsonl", cfg.reward.name if cfg.reward else "", cfg.reward_runner
        )

    def _build(self) -> None:
        cfg, host = self.cfg, self.host
        assert cfg.algorithm.loss is not None and cfg.algorithm.advantage is not None
        set_collective_timeout(cfg.trainer.collective_timeout_s)  # for a group the engine creates
        self.loss: PolicyLoss = build(host, POLICY_LOSS, cfg.algorithm.loss)
        self.advantage = build(host, ADVANTAGE, cfg.algorithm.advantage)
        self.filters: list[SampleFilter] = [build(host, SAMPLE_FILTER, s) for s in cfg.algorithm.filters]
        self.engine = build_engine(host, cfg.actor, trainable=True, built=self.built_engines)
        # reference, critic and teacher (core_rl/roles.py); critic and teacher hooks: trainer/critic.py, distill.py
        self.roles = build_roles(
            cfg,
            host,
            needs_reference=self.loss.requires_reference or self.advantage.requires_reference,
            needs_values=self.advantage.requires_values,
            built=self.built_engines,
        )
        self.ref = self.roles.ref
        if cfg.teacher is not None:
            self.loss = DistillationLoss(self.loss, cfg.teacher)
        if cfg.algorithm.ptx is not None:  # supervised rows in every optimiser step (trainer/ptx.py)
            self.loss = PTXLoss(self.loss)
        set_collective_timeout(cfg.trainer.collective_timeout_s)  # and for one that existed already
        self.rank, self.world_size = rank_and_world()
        # -- policy-gradient options (trainer/batching.py, trainer/update.py) ------------------
        spec = cfg.algorithm.rejection_sampling
        self.loss.set_rejection_sampler(build(host, REJECTION_SAMPLER, spec) if spec is not None else None)
        self.update = PolicyUpdate(
            engine=self.engine,
            ref=self.ref,
            loss=self.loss,
            algorithm=cfg.algorithm,
            temperature=cfg.rollout.sampling.temperature,
            shard=self._shard,
            world_size=self.world_size,
            teacher=self.roles.teacher,
            teacher_top_k=topk_of(cfg.teacher),
            critic=CriticStage.of_run(cfg, self.roles.critic, self.advantage, self._shard, self.world_size),
            advantage=self.advantage,
        )
        self.mismatch_budget = MismatchBudget(
            cfg.algorithm.mismatch_budget, is_main=self.rank == 0, correct=self._budget_correction(host)
        )
        if cfg.algorithm.reference_reset_every_n_steps:
            self.reference_reset = ReferenceReset.of_run(cfg, host, self.ref, self.is_main, self.engine)

        quiet_library_progress_bars()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.actor.tokenizer_path or cfg.actor.model_path, trust_remote_code=cfg.actor.trust_remote_code
        )
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        self.update.pad_token_id = self.pad_token_id
        if self.update.teacher_top_k is not None:  # the tokens the shared tokenizer has, and the actor's embedding
            sizes = (len(self.tokenizer), model_vocab_size(cfg.actor.model_path))
            self.update.student_vocab = min(size for size in sizes if size is not None)
        self.sampling = cfg.rollout.sampling.to_params()
        self.batcher = BatchAssembler(
            cfg.algorithm,
            filters=self.filters,
            advantage=self.advantage,
            prompts_per_step=cfg.data.batch_size,
            max_new_tokens=cfg.rollout.sampling.max_new_tokens,
            pad_token_id=self.pad_token_id,
            rewards_after_broadcast=self.roles.reward_model is not None,
            empty_steps=self.empty_steps,
            part_weights=combine_part_weights(cfg),
        )
        # the reward-model role scores on every rank after the broadcast (trainer/reward_role.py)
        self.reward_stage = reward_model_stage(
            self.roles.reward_model, cfg, self.batcher, self._shard, self.world_size, self.tokenizer, self.pad_token_id
        )

        # every rank has the data (only rank 0 draws from it) so a bad file fails on all ranks
        # at once instead of leaving the others waiting in a collective
        self.data = PromptSource(cfg.data, self.tokenizer, seed=cfg.experiment.seed, rows=self._data_rows)
        if cfg.algorithm.ptx is not None:
            rows = PTXRows(cfg.algorithm.ptx, cfg.data, self.tokenizer, seed=cfg.experiment.seed)
            self.update.ptx = rows
        # rank 0's own components: a failure is sent to the other ranks, which would wait otherwise
        error: Exception | None = None
        if self.is_main:
            try:
                if cfg.rollout.replay_from is None:
                    self._build_rollout()
                else:  # saved rollouts instead: no rollout engine, no reward (trainer/rollout_replay.py)
                    self.replay = RolloutReplay(cfg)
                self.loggers = build_loggers(cfg, host)
            except Exception as exc:
                error = exc
        else:
            self.rollout_sleep = peer_rollout_sleep(cfg, host)
        with held_by_peer(cfg, self.built_engines, self.is_main):  # servers on this rank's GPU size themselves
            agree_after("building the rollout engine, reward and loggers (rank 0)", error)

    def _build_rollout(self) -> None:
        """Rank 0's rollout engine, controller, reward, evaluator and rollout dump."""
        cfg, host = self.cfg, self.host  # with rollout.sleep_while_training resolved: trainer/colocation.py
        self.rollout, self.rollout_sleep = build_rollout_engine(cfg, host, self.run_dir, self.built_engines)
        workflow = build(host, WORKFLOW, cfg.rollout.workflow)
        self.flow = RolloutFlow(cfg, self.rollout, workflow, self.data, self.sampling, self.tokenizer)
        self.reward = build(host, REWARD, cfg.reward) if cfg.reward is not None else NoRuleReward()
        self.reward_runner = RewardRunner(self.reward, cfg.reward.name if cfg.reward else "", cfg.reward_runner)
        parts = {"engine": self.rollout, "tokenizer": self.tokenizer, "run_dir": self.run_dir}
        self.evaluator = build_evaluator(cfg, host, reward_runner=self.reward_runner, **parts)
        if cfg.rollout.dump.every_n_steps:  # each step's scored rollouts: trainer/rollout_dump.py
            self.dump = RolloutDump(cfg, self.run_dir, self.tokenizer)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _budget_correction(self, host: PluginHost) -> Callable[[], None] | None:
        """With ``algorithm.mismatch_budget.action: correct``: what turns its correction on (the policy
        loss receives the built ``correction`` sampler; a loss that cannot apply one is refused here,
        before training, as the configuration error it is). ``None`` otherwise."""
        budget = self.cfg.algorithm.mismatch_budget
        if budget.threshold is None or budget.action != "correct":
            return None
        sampler = build(host, REJECTION_SAMPLER, budget.correction)
        try:
            self.loss.set_rejection_sampler(sampler)
        except ConfigError as exc:
            refusal = "; ".join(exc.problems)
            raise ConfigError(
                [f"algorithm.mismatch_budget.action: 'correct' needs a loss that applies a correction ({refusal})"]
            ) from None
        self.loss.set_rejection_sampler(None)
        return functools.partial(self.loss.set_rejection_sampler, sampler)

    def _use_reference(self, ref: TrainEngine | None) -> None:
        self.ref = self.roles.ref = self.update.ref = ref

    def _shard(self, batch: TensorBatch) -> TensorBatch:
        """This rank's rows of a global batch (:func:`core_rl.engine_utils.packing.rank_rows`)."""
        return batch.rows(rank_rows(batch, self.rank, self.world_size, self.cfg.actor.micro_batch.rank_assignment))

    # -- one step -----------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        """Run RL step ``step`` (1-based) and return its metrics (complete on rank 0)."""
        assert self.engine is not None
        t0 = time.perf_counter()
        payload: tuple[TensorBatch | None, dict[str, float]] | None = None
        error: Exception | None = None
        if self.is_main:
            try:
                payload = self._rollout_and_score(step)
            except Exception as exc:
                error = exc
        batch, prep_metrics = broadcast_outcome(f"the batch of step {step} (rollout and rewards)", payload, error)
        metrics = dict(prep_metrics)
        generated = metrics.pop("throughput/generated_tokens", 0.0)
        metrics["throughput/generated_tokens_per_s"] = generated / max(metrics.get("timing/generate_s", 0.0), 1e-9)
        t_train = time.perf_counter()
        if batch is not None:
            if self.reward_stage is not None:  # reward-model scores, rewards, advantages: trainer/reward_role.py
                wait = f"the other ranks in the reward-model scores of step {step}"
                with PROGRESS.phase("reward", "the reward model"), waiting_for(wait):
                    metrics.update(self.reward_stage.prepare(batch))
                if self.is_main:
                    self._log_samples(step, batch[SCORES].tolist())
            # -- reference / recomputed log-probs, minibatches x epochs: trainer/update.py
            with PROGRESS.phase("update"), waiting_for(f"the other ranks in the update of step {step}"):
                update = self.update(batch, train_version=step)
            metrics.update(update)
            actor = {k.removeprefix("actor/"): v for k, v in update.items() if k.startswith("actor/")}
            metrics.update(self.nonfinite.check(step, self._shard(batch), actor))
            metrics.update(self.mismatch_budget.check(step, update))  # trainer/mismatch_budget.py
            metrics["throughput/train_tokens"] = float(batch["attention_mask"].sum()) * self.cfg.algorithm.ppo_epochs
        else:
            metrics["actor/skipped"] = 1.0
        t_sync = time.perf_counter()
        with PROGRESS.phase("sync"), waiting_for(f"the other ranks in the weight update after step {step}"):
            metrics.update(self._sync_weights(step))
        t_end = time.perf_counter()
        metrics["timing/train_s"] = t_sync - t_train
        metrics["timing/weight_sync_s"] = t_end - t_sync
        metrics["timing/step_s"] = t_end - t0
        metrics["weight_version"] = float(step)
        if "throughput/train_tokens" in metrics:
            metrics["throughput/tokens_per_s"] = metrics.pop("throughput/train_tokens") / max(t_end - t0, 1e-9)
        if self.flow is not None:
            metrics.update(self.flow.step_metrics(metrics, step))
        return metrics

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train up to ``trainer.total_steps`` steps; return where the results are."""
        try:
            return self._run()
        except DiskFullError:
            raise
        except Exception as exc:
            if is_disk_full(exc):
                raise self._disk_full(f"({exc})") from exc
            raise

    def _checkpoint_due(self, step: int) -> bool:
        """``saver.every_n_steps`` divides ``step``, or rank 0 finds ``saver.every_n_minutes``
        passed (sent to every rank, so they save together)."""
        every = self.cfg.saver.every_n_steps
        if every and step % every == 0:
            return True
        if not self.cfg.saver.every_n_minutes:
            return False
        return bool(broadcast_outcome(f"the checkpoint decision of step {step}", self.timed_saves.due(), None))

    def _run(self) -> dict[str, Any]:
        assert self.engine is not None
        cfg = self.cfg
        self.maybe_resume()
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
                    print(f"core-rl: note: {note}", file=sys.stderr, flush=True)
                self.reward_log.start(self.resume_step)
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
                raise self._interrupted(stop)
            with self._watchdog():
                export = self._steps()
        finally:
            for lg in started:
                lg.close()
        last = checkpoint_dir(self.run_dir, self.last_saved) if self.last_saved else None
        best = self.best_checkpoints
        return {
            "best_checkpoint": best.best_line(self.run_dir) if best and self.is_main else None,
            "run_dir": self.run_dir,
            "metrics": self.run_dir / "metrics.jsonl",
            "checkpoint": last,
            "export": export,
            "peak_memory": self.memory.summary(),
            "evaluation": self.evaluator.summary() if self.evaluator is not None else None,
        }

    def _watchdog(self) -> Watchdog:
        """This process's progress watchdog over the steps (:mod:`core_rl.trainer.watchdog`)."""
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
        if self.is_main:  # the last version's load: its error belongs to this run
            self.weight_load.wait()
        if cfg.saver.at_end and self.last_saved != self.completed_step:
            self.save_checkpoint(self.completed_step, metrics if self.is_main else None)
        export = None
        if cfg.saver.export_hf:
            export = self.run_dir / "final_hf"
            with PROGRESS.phase("export"), waiting_for("the other ranks to export the final model"):
                self.engine.export_hf(export)
        return export

    def _each_step(self) -> dict[str, Any]:
        """Steps :attr:`start_step` + 1 to ``trainer.total_steps`` (each timed for the watchdog,
        :mod:`core_rl.progress`); the last one's metrics."""
        assert self.engine is not None
        cfg = self.cfg
        metrics: dict[str, Any] = {}
        for step in range(self.start_step + 1, cfg.trainer.total_steps + 1):
            PROGRESS.begin_step(step)
            with self.profiler.around(step):
                metrics = self.step(step)
            metrics.update(self.memory.step_metrics())  # trainer/memory.py
            if self.profiler.wants(step):
                metrics = {**metrics, "profile/active": 1.0}
            self.completed_step = step
            error = None
            if self.is_main:
                try:
                    metrics.update(self._evaluation(step))
                    with PROGRESS.phase("logging"):
                        for lg in self.loggers:
                            lg.log(metrics, step)
                except Exception as exc:
                    error = exc
            stop = agree_after(f"step {step}", error, self.stop.requested)
            if (budget := getattr(self, "mismatch_budget", None)) is not None:  # loops without an RL update have none
                budget.stop_if_exceeded()  # after logging the step, before saving it
            if self.reference_reset is not None:  # before the checkpoint, which may need its export
                self._use_reference(self.reference_reset.after_step(step, self.engine, self.ref))
            if self._checkpoint_due(step) or stop:
                self.save_checkpoint(step, metrics if self.is_main else None)
            if export_due(cfg.saver, step):
                with PROGRESS.phase("export"):
                    export_step(self.engine, cfg.saver, self.run_dir, step, is_main=self.is_main)
            if stop:
                raise self._interrupted(stop)
        return metrics

    def close(self) -> None:
        if getattr(self, "weight_load", None) is not None:
            self.weight_load.close()
        if self.flow is not None:
            self.flow.close()
            self.flow = None
        if self.reward_runner is not None:
            self.reward_runner.close()
            self.reward_runner = None
        for component in (self.rollout, self.engine, self.reward):
            if component is not None:
                component.close()
        if getattr(self, "roles", None) is not None:
            self.roles.close()
        self.rollout = self.ref = self.engine = self.reward = None


def train(cfg: RunConfig, *, host: PluginHost) -> Mapping[str, Any]:
    """Check the data, model, machine and output directory (:mod:`core_rl.preflight`), derive
    ``trainer.total_steps`` from ``trainer.total_epochs`` when set (:mod:`core_rl.config.epochs`),
    then build a trainer for ``cfg`` and run it, restarting after a crash as ``recover`` says
    (:func:`core_rl.trainer.recover.run_with_restarts`); rank 0 prints the run's summary
    (:func:`core_rl.trainer.summary.summary_lines`)."""
    from core_rl.trainer.recover import run_with_restarts

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
