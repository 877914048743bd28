"""The synchronous RL loop.

One step: prompts -> rollout (n samples each) -> rewards -> sample filters (drawing more prompt
batches while dynamic sampling asks for them) -> reward shaping, advantages and loss weights
(:mod:`core_rl.loops.rl.batching`) -> reference / recomputed log-probs and ``ppo_n_minibatches`` x
``ppo_epochs`` optimiser steps (:mod:`core_rl.loops.rl.update`) -> weights to the rollout engine ->
metrics to every logger -> checkpoint on the saver's schedule. With a ``reward_model:`` role the
reward model's scores, reward shaping and advantages come after the batch is sent, on every rank
(:mod:`core_rl.loops.rl.reward_model`).

Under ``torchrun`` every rank runs this loop with its own train-engine shard; rank 0 alone owns the
rollout engine, rewards and loggers, and broadcasts each step's batch to the other ranks; each rank
trains on the rows :func:`core_rl.data.balance.rank_rows` assigns it (token-balanced by
default). Every wait on another rank is bounded and a failure on one rank is sent to the others
(:mod:`core_rl.launch.ranks`).

:meth:`SyncTrainer.step` is a handful of stage calls: rank 0's rollout and scoring
(:class:`~core_rl.loops.rl.scoring.RolloutScoringStage`: generation batches, rewards,
filters, shaping, advantages, assembled into the batch), sent to every rank; the reward model's
scores (:mod:`core_rl.loops.rl.reward_model`); the update (:class:`~core_rl.loops.rl.update.PolicyUpdate`);
the weight sync (:class:`~core_rl.sync.weight_sync.WeightSyncStage`). The run around the steps
(:class:`~core_rl.loops.scaffold.RunScaffold`, shared with the supervised loops) evaluates
(:class:`~core_rl.eval.evaluator.EvaluationStage`) and logs each step, then checkpoints it
(:class:`~core_rl.checkpoint.resume.CheckpointStage`). The other parts live beside it: building
components (:mod:`core_rl.loops.building`), what the rewards and loggers see of samples
(:mod:`core_rl.loops.rl.sample_log`), the ``auto`` micro-batch budgets chosen once the engines are
built (:mod:`core_rl.loops.auto_budget`), each step's memory figures (:mod:`core_rl.loops.memory`).
The generic ``train()`` is :func:`core_rl.loops.run.train`.

Faults: rewards run through :class:`~core_rl.loops.rl.reward_runner.RewardRunner` (timeouts, per-item
``on_error``); non-finite steps go through :class:`~core_rl.loops.numerics.NonFiniteGuard`; a
SIGINT/SIGTERM (:mod:`core_rl.loops.signals`) ends the loop after the current step with a
checkpoint; resuming picks the newest valid checkpoint (:mod:`core_rl.checkpoint.store`) and
restores every RNG the run uses, the data position, the rollout engine's state and the counters.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from core_rl.config.reward_aggregation import reward_part_weights
from core_rl.config.schema import RunConfig
from core_rl.config.teacher_checks import model_vocab_size
from core_rl.data.prompts import DataRow, PromptSource
from core_rl.errors import ConfigError, warn
from core_rl.eval.evaluator import EvaluationStage, Evaluator, build_evaluator
from core_rl.interfaces import (
    AdvantageEstimator,
    PolicyLoss,
    Reward,
    RolloutEngine,
    SampleFilter,
    TrainEngine,
)
from core_rl.launch.ranks import (
    agree_after,
    broadcast_outcome,
    rank_and_world,
    set_collective_timeout,
    waiting_for,
)
from core_rl.loops.building import build, build_loggers
from core_rl.loops.rl.batching import BatchAssembler
from core_rl.loops.rl.critic import CRITIC_DIR, CriticStage
from core_rl.loops.rl.distill import DistillationLoss, topk_of
from core_rl.loops.rl.failed_steps import FailedSteps
from core_rl.loops.rl.filtering import EmptySteps
from core_rl.loops.rl.mismatch_budget import MismatchBudget
from core_rl.loops.rl.ptx import PTXLoss, PTXRows
from core_rl.loops.rl.reference_reset import ReferenceReset
from core_rl.loops.rl.reward_model import SCORES, NoRuleReward, reward_model_stage
from core_rl.loops.rl.reward_runner import RewardErrorLog, RewardRunner
from core_rl.loops.rl.rollout_flow import RolloutFlow
from core_rl.loops.rl.scoring import RolloutScoringStage
from core_rl.loops.rl.update import PolicyUpdate, no_signal_warning
from core_rl.loops.scaffold import RunScaffold
from core_rl.loops.signals import StopSignals
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import (
    ADVANTAGE,
    POLICY_LOSS,
    REJECTION_SAMPLER,
    REWARD,
    SAMPLE_FILTER,
    WORKFLOW,
)
from core_rl.protocol import TensorBatch
from core_rl.reliability.progress import PROGRESS
from core_rl.roles.build import build_engine, build_roles
from core_rl.rollout.colocated_memory import held_by_peer
from core_rl.rollout.colocation import RolloutSleep, build_rollout_engine, peer_rollout_sleep
from core_rl.rollout.dump import RolloutDump
from core_rl.rollout.replay import RolloutReplay
from core_rl.sync.background_load import BackgroundWeightLoad
from core_rl.sync.weight_sync import WeightSyncStage


class SyncTrainer(RunScaffold):
    """Builds every component a :class:`RunConfig` selects and runs the synchronous loop; its
    stages: :attr:`scoring` (rollout and rewards, rank 0), :attr:`update` (the policy update),
    :attr:`syncing` (weights to the rollout engine), :attr:`evaluation`, and the scaffold's
    :attr:`checkpoints`."""

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
        self.rollout: RolloutEngine | None = None
        self.rollout_sleep = RolloutSleep()  # rank 0's is built with the engine (rollout/colocation.py)
        self.advantage: AdvantageEstimator | None = None
        self.reward: Reward | None = None
        self.reward_runner: RewardRunner | None = None
        self.evaluator: Evaluator | None = None  # rank 0's, with an eval: section (eval/evaluator.py)
        #: rank 0's rollout controller (:mod:`core_rl.loops.rl.rollout_flow`)
        self.flow: RolloutFlow | None = None
        #: rank 0's ``rollout.dump`` / ``rollout.replay_from`` (:mod:`core_rl.rollout.dump`, ``rollout_replay``)
        self.dump: RolloutDump | None = None
        self.replay: RolloutReplay | None = None
        #: steps the sample filters left with nothing to train on (:mod:`core_rl.loops.rl.filtering`)
        self.empty_steps = EmptySteps(cfg.algorithm.max_consecutive_empty_steps)
        #: steps whose every episode failed (:mod:`core_rl.loops.rl.failed_steps`)
        self.failed_steps = FailedSteps(cfg.algorithm.max_consecutive_failed_steps)
        #: rank 0's weight load running beside the trainer (asynchronous runs, disk sync)
        self.weight_load = BackgroundWeightLoad(
            cfg.rollout.controller.wait_timeout_s, "rollout.controller.wait_timeout_s"
        )
        super().__init__(cfg, host, stop=stop, data_rows=data_rows)
        assert self.engine is not None
        self.reward_log = RewardErrorLog(
            self.run_dir / "reward_errors.jsonl", cfg.reward.name if cfg.reward else "", cfg.reward_runner
        )
        # -- the step's stages -------------------------------------------------------------------
        self.scoring = RolloutScoringStage(
            cfg,
            data=self.data,
            flow=self.flow,
            dump=self.dump,
            replay=self.replay,
            reward_runner=self.reward_runner,
            reward_log=self.reward_log,
            reward_stage=self.reward_stage,
            rollout_sleep=self.rollout_sleep,
            batcher=self.batcher,
            loggers=self.loggers,
            tokenizer=self.tokenizer,
            failed_steps=self.failed_steps,
        )
        self.syncing = WeightSyncStage(
            cfg,
            engine=self.engine,
            rollout=self.rollout,
            flow=self.flow,
            weight_load=self.weight_load,
            rollout_sleep=self.rollout_sleep,
            is_main=self.is_main,
        )
        self.evaluation = EvaluationStage(
            cfg, self.progress, evaluator=self.evaluator, weight_load=self.weight_load, rollout_sleep=self.rollout_sleep
        )

    def _build(self) -> None:
        cfg, host = self.cfg, self.host
        assert cfg.algorithm.loss is not None and cfg.algorithm.advantage is not None
        set_collective_timeout(cfg.trainer.collective_timeout_s)  # for a group the engine creates
        self.loss: PolicyLoss = build(host, POLICY_LOSS, cfg.algorithm.loss)
        self.advantage = build(host, ADVANTAGE, cfg.algorithm.advantage)
        self.filters: list[SampleFilter] = [build(host, SAMPLE_FILTER, s) for s in cfg.algorithm.filters]
        self.engine = build_engine(host, cfg.actor, trainable=True, built=self.built_engines)
        # reference, critic and teacher (core_rl/roles/build.py); critic and teacher hooks: loops/rl/critic.py,
        # distill.py
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
        if cfg.algorithm.ptx is not None:  # supervised rows in every optimiser step (loops/rl/ptx.py)
            self.loss = PTXLoss(self.loss)
        set_collective_timeout(cfg.trainer.collective_timeout_s)  # and for one that existed already
        self.rank, self.world_size = rank_and_world()
        # -- policy-gradient options (loops/rl/batching.py, loops/rl/update.py) ------------------
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

        self._load_tokenizer()
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
            part_weights=reward_part_weights(cfg),
        )
        # the reward-model role scores on every rank after the broadcast (loops/rl/reward_model.py)
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
                else:  # saved rollouts instead: no rollout engine, no reward (rollout/replay.py)
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
        cfg, host = self.cfg, self.host  # with rollout.sleep_while_training resolved: rollout/colocation.py
        self.rollout, self.rollout_sleep = build_rollout_engine(cfg, host, self.run_dir, self.built_engines)
        workflow = build(host, WORKFLOW, cfg.rollout.workflow)
        self.flow = RolloutFlow(cfg, self.rollout, workflow, self.data, self.sampling, self.tokenizer)
        self.reward = build(host, REWARD, cfg.reward) if cfg.reward is not None else NoRuleReward()
        self.reward_runner = RewardRunner(self.reward, cfg.reward.name if cfg.reward else "", cfg.reward_runner)
        parts = {"engine": self.rollout, "tokenizer": self.tokenizer, "run_dir": self.run_dir}
        self.evaluator = build_evaluator(cfg, host, reward_runner=self.reward_runner, **parts)
        if cfg.rollout.dump.every_n_steps:  # each step's scored rollouts: rollout/dump.py
            self.dump = RolloutDump(cfg, self.run_dir, self.tokenizer)

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

    # -- the scaffold's hooks (loops/scaffold.py) -----------------------------------------------

    def _saved_state(self) -> dict[str, Any]:
        update = self.update
        return {
            **super()._saved_state(),
            # the data position before the controller's first wave not yet trained on
            "data": self.flow.state_dict()["data"] if self.flow is not None else self.data.state_dict(),
            "controller": self.flow.state_dict() if self.flow is not None else {},
            "rollout": self.rollout.state_dict() if self.rollout is not None else {},
            "empty_steps": self.empty_steps.state_dict(),
            "failed_steps": self.failed_steps.state_dict(),
            "reward_errors": self.reward_log.state_dict(),
            "advantage": self.advantage.state_dict() if self.advantage is not None else {},
            "loss": self.loss.state_dict(),
            "ptx": update.ptx.state_dict() if update.ptx else {},
            # the run's count of zero-signal updates (loops/rl/update.py)
            "zero_signal": update.zero_signal.state_dict() if update.zero_signal else {},
            # algorithm.mismatch_budget's count and correction (loops/rl/mismatch_budget.py)
            "mismatch_budget": self.mismatch_budget.state_dict(),
        }

    def _restore_state(self, extra: Mapping[str, Any], step: int) -> None:
        """The scaffold's part, then the controller, the rollout engine and every counter; then the
        resumed weights go to the rollout engine."""
        super()._restore_state(extra, step)
        if self.flow is not None:
            self.flow.load_state_dict(extra.get("controller", {}), step)
        if self.rollout is not None:
            self.rollout.load_state_dict(extra.get("rollout", {}))
        self.empty_steps.load_state_dict(extra.get("empty_steps", {}))
        self.failed_steps.load_state_dict(extra.get("failed_steps", {}))
        self.reward_log.load_state_dict(extra.get("reward_errors", {}))
        if self.advantage is not None:
            self.advantage.load_state_dict(extra.get("advantage", {}))
        self.loss.load_state_dict(extra.get("loss", {}))
        if self.update.ptx is not None:
            self.update.ptx.load_state_dict(extra.get("ptx", {}))
        if self.update.zero_signal is not None:
            self.update.zero_signal.load_state_dict(extra.get("zero_signal", {}))
        self.mismatch_budget.load_state_dict(extra.get("mismatch_budget", {}))
        with waiting_for("the other ranks to send the resumed weights to the rollout engine"):
            self.syncing.sync(step)

    def _trained_roles(self) -> dict[str, TrainEngine]:
        return {CRITIC_DIR: self.roles.critic} if self.roles.critic is not None else {}

    def _settle(self) -> None:
        self.weight_load.wait()  # the rollout engine's state is saved too: its load must be done

    def _on_start(self) -> None:
        self.reward_log.start(self.resume_step)

    def _eval_due(self, step: int) -> bool:
        return self.evaluation.due(step)

    def _evaluation(self, step: int) -> dict[str, float]:
        return self.evaluation.after(step)

    def _evaluation_summary(self) -> str | None:
        return self.evaluation.summary()

    def _after_logged(self, step: int) -> None:
        self.mismatch_budget.stop_if_exceeded()  # after logging the step, before saving it

    # -- one step -----------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        """Run RL step ``step`` (1-based) and return its metrics (complete on rank 0). The
        checkpoint, when due, follows the step's logging (:meth:`RunScaffold._finish_step`)."""
        t0 = time.perf_counter()
        batch, metrics = self._rollout_and_score(step)  # rank 0: rollout, rewards, filters, advantages
        t_train = time.perf_counter()
        if batch is not None:
            metrics.update(self._score_by_reward_model(step, batch))  # the reward_model: role, every rank
            metrics.update(self._update(step, batch))  # log-probs, minibatches x epochs
            self._warn_without_signal(step, metrics)
        else:
            metrics["actor/skipped"] = 1.0
        t_sync = time.perf_counter()
        metrics.update(self._sync(step))  # the new weights to the rollout engine
        return self._step_metrics(step, metrics, (t0, t_train, t_sync, time.perf_counter()))

    def _rollout_and_score(self, step: int) -> tuple[TensorBatch | None, dict[str, float]]:
        """Rank 0's :meth:`RolloutScoringStage.rollout_and_score` (generation batches, rewards,
        filters, shaping, advantages), sent to every rank: the batch to train on (``None``: nothing
        left) and the metrics so far."""
        payload: tuple[TensorBatch | None, dict[str, float]] | None = None
        error: Exception | None = None
        if self.is_main:
            try:
                payload = self.scoring.rollout_and_score(step)
            except Exception as exc:
                error = exc
        batch, prep_metrics = broadcast_outcome(f"the batch of step {step} (rollout and rewards)", payload, error)
        metrics = dict(prep_metrics)
        generated = metrics.pop("throughput/generated_tokens", 0.0)
        metrics["throughput/generated_tokens_per_s"] = generated / max(metrics.get("timing/generate_s", 0.0), 1e-9)
        return batch, metrics

    def _score_by_reward_model(self, step: int, batch: TensorBatch) -> dict[str, float]:
        """With a ``reward_model:`` role: its scores, the rewards and advantages on every rank
        (:mod:`core_rl.loops.rl.reward_model`), then rank 0's sample log. Nothing otherwise."""
        if self.reward_stage is None:
            return {}
        wait = f"the other ranks in the reward-model scores of step {step}"
        with PROGRESS.phase("reward", "the reward model"), waiting_for(wait):
            metrics = dict(self.reward_stage.prepare(batch))
        if self.is_main:
            self.scoring.log_samples(step, batch[SCORES].tolist())
        return metrics

    def _update(self, step: int, batch: TensorBatch) -> dict[str, float]:
        """The policy update (:class:`~core_rl.loops.rl.update.PolicyUpdate`: reference / recomputed
        log-probs, minibatches x epochs) on every rank, then the non-finite and mismatch-budget
        checks."""
        assert self.engine is not None
        with PROGRESS.phase("update"), waiting_for(f"the other ranks in the update of step {step}"):
            update = self.update(batch, train_version=step)
        metrics = dict(update)
        actor = {k.removeprefix("actor/"): v for k, v in update.items() if k.startswith("actor/")}
        metrics.update(self.nonfinite.check(step, self._shard(batch), actor))
        metrics.update(self.mismatch_budget.check(step, update))  # loops/rl/mismatch_budget.py
        metrics["throughput/train_tokens"] = float(batch["attention_mask"].sum()) * self.cfg.algorithm.ppo_epochs
        return metrics

    def _warn_without_signal(self, step: int, metrics: Mapping[str, float]) -> None:
        """Rank 0: warn once ``trainer.warn_no_signal_steps`` updates in a row carried no learning
        signal (:func:`~core_rl.loops.rl.update.no_signal_warning`)."""
        line = no_signal_warning(
            step,
            self.update.zero_signal.streak,
            metrics,
            after=self.cfg.trainer.warn_no_signal_steps,
            max_new_tokens=self.cfg.rollout.sampling.max_new_tokens,
        )
        if line is not None and self.is_main:
            warn(line)

    def _sync(self, step: int) -> dict[str, float]:
        """The weight-sync stage after step ``step``, on every rank."""
        with PROGRESS.phase("sync"), waiting_for(f"the other ranks in the weight update after step {step}"):
            return self.syncing.sync(step)

    def _step_metrics(
        self, step: int, metrics: dict[str, float], times: tuple[float, float, float, float]
    ) -> dict[str, float]:
        """The step's timings (``times``: its start, the update's, the sync's, its end), weight
        version and throughput added to ``metrics``, and the rollout controller's figures."""
        t0, t_train, t_sync, t_end = times
        metrics["timing/train_s"] = t_sync - t_train
        metrics["timing/weight_sync_s"] = t_end - t_sync
        metrics["timing/step_s"] = t_end - t0
        metrics["weight_version"] = float(step)
        if "throughput/train_tokens" in metrics:
            metrics["throughput/tokens_per_s"] = metrics.pop("throughput/train_tokens") / max(t_end - t0, 1e-9)
        if self.flow is not None:
            metrics.update(self.flow.step_metrics(metrics, step))
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
        if self.rollout is not None:
            self.rollout.close()
        super().close()
        if self.reward is not None:
            self.reward.close()
        if getattr(self, "roles", None) is not None:
            self.roles.close()
        self.rollout = self.reward = None
