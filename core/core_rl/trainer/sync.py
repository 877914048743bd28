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

Faults: rewards run through :class:`~core_rl.trainer.rewards.RewardRunner` (timeouts, per-item
``on_error``); non-finite steps go through :class:`~core_rl.trainer.numerics.NonFiniteGuard`; a
SIGINT/SIGTERM (:mod:`core_rl.trainer.signals`) ends the loop after the current step with a
checkpoint; resuming picks the newest valid checkpoint (:mod:`core_rl.trainer.checkpoints`) and
restores every RNG the run uses, the data position, the rollout engine's state and the counters.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from core_rl.checkpointing import discard_partial
from core_rl.config.loader import to_plain
from core_rl.config.schema import PluginSpec, RunConfig
from core_rl.engine_utils.packing import rank_rows
from core_rl.errors import CoreRLError
from core_rl.interfaces import (
    AdvantageEstimator,
    Logger,
    PolicyLoss,
    Reward,
    RolloutEngine,
    RunInfo,
    SampleFilter,
    SampleRecord,
    TrainEngine,
    TrainingLoop,
)
from core_rl.kinds import (
    ADVANTAGE,
    LOGGER,
    POLICY_LOSS,
    REJECTION_SAMPLER,
    REWARD,
    ROLLOUT_ENGINE,
    SAMPLE_FILTER,
    TRAIN_ENGINE,
    WORKFLOW,
    PluginKind,
)
from core_rl.plugins import PluginHost
from core_rl.preflight import preflight
from core_rl.protocol import RewardInput, Sample, TensorBatch
from core_rl.roles import build_roles
from core_rl.trainer import checkpoints
from core_rl.trainer.batching import BatchAssembler, Generation
from core_rl.trainer.critic import CRITIC_DIR, CriticStage, check_role_states, load_role_states, save_role_states
from core_rl.trainer.data import DataRow, PromptItem, PromptSource
from core_rl.trainer.distill import DistillationLoss
from core_rl.trainer.errors import DiskFullError, RunFailed, TrainingInterrupted
from core_rl.trainer.filtering import EmptySteps
from core_rl.trainer.numerics import NonFiniteGuard
from core_rl.trainer.profiling import StepProfiler
from core_rl.trainer.ranks import (
    agree_after,
    broadcast_outcome,
    rank_and_world,
    set_collective_timeout,
    waiting_for,
)
from core_rl.trainer.reward_role import SCORES, NoRuleReward, reward_model_stage
from core_rl.trainer.rewards import RewardErrorLog, RewardRunner, ScoreResult
from core_rl.trainer.rollout_flow import RolloutFlow, flatten_groups
from core_rl.trainer.run_config import record_config, resume_note
from core_rl.trainer.signals import StopSignals
from core_rl.trainer.update import PolicyUpdate
from core_rl.trainer.weight_load import BackgroundWeightLoad


def _build(host: PluginHost, kind: PluginKind, spec: PluginSpec) -> Any:
    """Build a component whose factory takes its validated section (``None`` without options)."""
    return host.get(kind, spec.name).factory(spec.config)


def build_loggers(cfg: RunConfig, host: PluginHost) -> list[Logger]:
    """The configured loggers, plus ``jsonl`` when absent: every run leaves its metrics file."""
    specs = list(cfg.loggers)
    if not any(s.name == "jsonl" for s in specs):
        specs.append(PluginSpec(name="jsonl", config=host.get(LOGGER, "jsonl").config_cls()))
    return [_build(host, LOGGER, s) for s in specs]


def _quiet_library_progress_bars() -> None:
    """The console logger is the run's progress bar; silence the per-load bars of libraries.
    ``datasets`` is told through its environment variable unless a plugin imported it already:
    importing it only to switch its bars off cost about 86 MiB of resident memory per run."""
    import transformers

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    datasets = sys.modules.get("datasets")
    if datasets is not None:
        datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def warn(message: str) -> None:
    print(f"core-rl: warning: {message}", file=sys.stderr, flush=True)


def effective_recover_mode(cfg: RunConfig) -> str:
    """``recover.mode``, with the older ``trainer.resume: true`` meaning ``auto``."""
    if cfg.recover.mode == "disabled" and cfg.trainer.resume:
        return "auto"
    return cfg.recover.mode


class SyncTrainer(TrainingLoop):
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
        seed = cfg.experiment.seed
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        random.seed(seed)
        torch.manual_seed(seed)
        self.run_dir = Path(cfg.experiment.output_dir) / cfg.experiment.name
        self.recover_mode = effective_recover_mode(cfg)
        if self.recover_mode == "disabled" and (self.run_dir / "metrics.jsonl").exists():
            raise CoreRLError(
                f"run directory {self.run_dir} already holds a run; set recover.mode=auto (or trainer.resume=true) "
                "to continue it, or choose another experiment.name"
            )
        self.rollout: RolloutEngine | None = None
        #: the advantage estimator (``None`` in loops that have none, e.g. the supervised ones)
        self.advantage: AdvantageEstimator | None = None
        self.reward: Reward | None = None
        self.reward_runner: RewardRunner | None = None
        self.loggers: list[Logger] = []
        self.ref: TrainEngine | None = None
        self.engine: TrainEngine | None = None
        #: rank 0's rollout controller (:mod:`core_rl.trainer.rollout_flow`)
        self.flow: RolloutFlow | None = None
        #: steps the sample filters left with nothing to train on (:mod:`core_rl.trainer.filtering`)
        self.empty_steps = EmptySteps(cfg.algorithm.max_consecutive_empty_steps)
        #: rank 0's weight load running beside the trainer (asynchronous runs, disk sync)
        self.weight_load = BackgroundWeightLoad(
            cfg.rollout.controller.wait_timeout_s, "rollout.controller.wait_timeout_s"
        )
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.start_step = 0
        # (reward inputs, scores) of each generation batch of the current step, for sample logging
        self._scored_this_step: list[tuple[list[RewardInput], ScoreResult]] = []
        self.completed_step = 0
        self.last_saved: int | None = None
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
        self.loss: PolicyLoss = _build(host, POLICY_LOSS, cfg.algorithm.loss)
        self.advantage = _build(host, ADVANTAGE, cfg.algorithm.advantage)
        self.filters: list[SampleFilter] = [_build(host, SAMPLE_FILTER, s) for s in cfg.algorithm.filters]
        engine_entry = host.get(TRAIN_ENGINE, cfg.actor.engine.name)
        self.engine = engine_entry.factory(cfg.actor, cfg.actor.engine.config, trainable=True)
        # reference, critic and teacher (core_rl/roles.py); critic and teacher hooks: trainer/critic.py, distill.py
        self.roles = build_roles(
            cfg,
            host,
            needs_reference=self.loss.requires_reference or self.advantage.requires_reference,
            needs_values=self.advantage.requires_values,
        )
        self.ref = self.roles.ref
        if cfg.teacher is not None:
            self.loss = DistillationLoss(self.loss, cfg.teacher)
        set_collective_timeout(cfg.trainer.collective_timeout_s)  # and for one that existed already
        self.rank, self.world_size = rank_and_world()
        # -- policy-gradient options (trainer/batching.py, trainer/update.py) ------------------
        spec = cfg.algorithm.rejection_sampling
        self.loss.set_rejection_sampler(_build(host, REJECTION_SAMPLER, spec) if spec is not None else None)
        self.update = PolicyUpdate(
            engine=self.engine,
            ref=self.ref,
            loss=self.loss,
            algorithm=cfg.algorithm,
            temperature=cfg.rollout.sampling.temperature,
            shard=self._shard,
            world_size=self.world_size,
            teacher=self.roles.teacher,
            critic=self._critic_stage(),
        )

        _quiet_library_progress_bars()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor.tokenizer_path or cfg.actor.model_path)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
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
        )
        # the reward-model role scores on every rank after the broadcast (trainer/reward_role.py)
        self.reward_stage = reward_model_stage(
            self.roles.reward_model, cfg, self.batcher, self._shard, self.world_size, self.tokenizer, self.pad_token_id
        )

        # every rank has the data (only rank 0 draws from it) so a bad file fails on all ranks
        # at once instead of leaving the others waiting in a collective
        self.data = PromptSource(cfg.data, self.tokenizer, seed=cfg.experiment.seed, rows=self._data_rows)
        # rank 0's own components: a failure is sent to the other ranks, which would wait otherwise
        error: Exception | None = None
        if self.is_main:
            try:
                self.rollout = host.get(ROLLOUT_ENGINE, cfg.rollout.engine.name).factory(
                    cfg.rollout, cfg.rollout.engine.config, model_path=cfg.actor.model_path, run_dir=self.run_dir
                )
                workflow = _build(host, WORKFLOW, cfg.rollout.workflow)
                self.flow = RolloutFlow(cfg, self.rollout, workflow, self.data, self.sampling, self.tokenizer)
                self.reward = _build(host, REWARD, cfg.reward) if cfg.reward is not None else NoRuleReward()
                self.reward_runner = RewardRunner(self.reward, cfg.reward.name if cfg.reward else "", cfg.reward_runner)
                self.loggers = build_loggers(cfg, host)
            except Exception as exc:
                error = exc
        agree_after("building the rollout engine, reward and loggers (rank 0)", error)

    def _critic_stage(self) -> CriticStage | None:
        if self.roles.critic is None:
            return None
        assert self.cfg.critic is not None
        return CriticStage(
            critic=self.roles.critic,
            config=self.cfg.critic,
            advantage=self.advantage,
            algorithm=self.cfg.algorithm,
            shard=self._shard,
            world_size=self.world_size,
        )

    def _trained_roles(self) -> dict[str, TrainEngine]:
        """The trained roles besides the actor, saved in ``<checkpoint>/<role>``."""
        roles = getattr(self, "roles", None)  # loops that build their own models have none
        return {CRITIC_DIR: roles.critic} if roles is not None and roles.critic is not None else {}

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _shard(self, batch: TensorBatch) -> TensorBatch:
        """This rank's rows of a global batch (:func:`core_rl.engine_utils.packing.rank_rows`)."""
        return batch.rows(rank_rows(batch, self.rank, self.world_size, self.cfg.actor.micro_batch.rank_assignment))

    # -- one step -----------------------------------------------------------------------------

    def _rollout(self) -> tuple[list[Sample], list[int], list[PromptItem]]:
        """The next generation batch from the rollout controller (the first of a step or, under
        dynamic sampling, a further one), flattened: samples, their group, their prompt."""
        assert self.flow is not None
        wave = self.flow.take(new_step=not self._scored_this_step)
        return flatten_groups(wave.prompts, wave.groups)

    def _score(
        self, samples: list[Sample], owners: list[PromptItem], step: int
    ) -> tuple[list[RewardInput], ScoreResult, dict[str, float]]:
        """Score ``samples`` through the reward runner; failed items are logged and counted."""
        assert self.reward_runner is not None
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        inputs = [
            RewardInput(
                prompt_text=owner.text,
                response_text=text,
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                row=owner.row,
                finish_reason=s.finish_reason,
                workflow_reward=s.reward,
                info=s.info,
            )
            for s, text, owner in zip(samples, texts, owners)
        ]
        result = self.reward_runner.score(inputs, step=step)
        return inputs, result, self.reward_log.record(step, inputs, result)

    def _generate_scored(self, step: int) -> Generation:
        """One generation batch: the next prompts, their samples and rewards (items the reward
        runner dropped are left out), with timings and reward-error counts."""
        t0 = time.perf_counter()
        samples, group_index, owners = self._rollout()
        t_gen = time.perf_counter()
        inputs, result, error_metrics = self._score(samples, owners, step)
        self._scored_this_step.append((inputs, result))
        t_reward = time.perf_counter()
        kept = result.kept
        metrics = {
            "timing/generate_s": t_gen - t0,
            "timing/reward_s": t_reward - t_gen,
            "throughput/generated_tokens": float(sum(len(s.response_ids) for s in samples)),
            "reward/errors": error_metrics["reward/errors"],
            "reward/dropped": error_metrics["reward/dropped"],
            **{k: v for k, v in error_metrics.items() if k.startswith("reward/errors_") and k != "reward/errors_total"},
        }
        return Generation(
            samples=[samples[i] for i in kept],
            group_index=[group_index[i] for i in kept],
            rewards=[float(result.scores[i]) for i in kept],  # type: ignore[arg-type]
            metrics=metrics,
            reward_parts={name: [values[i] for i in kept] for name, values in result.parts.items()},
        )

    def _log_samples(self, step: int, model_scores: list[float] | None = None) -> None:
        """Every ``sample_log.every_n_steps`` steps, hand ``num_samples`` samples spread over the
        step's first generation batch to every logger. ``model_scores``: the ``reward_model:``
        role's score of each kept sample (the batch's rows, in order); a sample's reward is then
        ``rule + coef * score``, with the score as the part ``reward_model``."""
        if not self._scored_this_step:
            return
        inputs, result = self._scored_this_step[0]
        every, k = self.cfg.sample_log.every_n_steps, min(self.cfg.sample_log.num_samples, len(inputs))
        if not every or step % every or not k:
            return
        score_of = dict(zip(result.kept, model_scores)) if model_scores is not None else {}
        records = []
        for i in sorted({j * len(inputs) // k for j in range(k)}):
            reward = float("nan") if result.scores[i] is None else float(result.scores[i])  # type: ignore[arg-type]
            parts = {name: float(values[i]) for name, values in result.parts.items()}
            if i in score_of and self.reward_stage is not None:
                parts["reward_model"] = score_of[i]
                reward += self.reward_stage.config.coef * score_of[i]
            records.append(
                SampleRecord(
                    prompt=inputs[i].prompt_text,
                    response=inputs[i].response_text,
                    reward=reward,
                    finish_reason=inputs[i].finish_reason,
                    parts=parts,
                    info=dict(inputs[i].info),
                )
            )
        for lg in self.loggers:
            lg.log_samples(records, step)

    def _rollout_paused(self, version: int) -> AbstractContextManager[None]:
        """Rank 0: the rollout controller paused while the engine loads ``version``."""
        return self.flow.paused(version) if self.flow is not None else contextlib.nullcontext()

    def _loads_in_background(self) -> bool:
        """Whether the rollout engine loads a written version while the trainer goes on
        (:mod:`core_rl.trainer.weight_load`): an asynchronous run syncing by disk, once its
        controller runs (a resumed run's first load must land before the controller starts)."""
        return (
            self.cfg.rollout.weight_sync == "disk"
            and self.cfg.rollout.controller.max_head_offpolicyness > 0
            and self.flow is not None
            and self.flow.controller is not None
        )

    def _sync_weights(self, version: int) -> dict[str, float]:
        """Move the policy's weights to the rollout engine; return ``weight_sync/bytes`` (and,
        when loads run in the background, the wait for the previous one and its duration)."""
        mode = self.cfg.rollout.weight_sync
        if mode == "disk":
            metrics: dict[str, float] = {}
            if self.is_main:  # the directory is rewritten below: the previous load must be done
                waited = self.weight_load.wait()
                if self._loads_in_background():
                    metrics["timing/weight_load_wait_s"] = waited
                    metrics["timing/weight_load_s"] = self.weight_load.last_load_s
            path = self.run_dir / "weight_sync"
            self.engine.export_hf(path)
            metrics["weight_sync/bytes"] = float(sum(f.stat().st_size for f in path.glob("*.safetensors")))
            if self.rollout is not None:
                rollout = self.rollout

                def load() -> None:
                    with self._rollout_paused(version):
                        rollout.load_weights_from_path(path, version)

                if self._loads_in_background():
                    self.weight_load.start(load, version)
                else:
                    load()
            return metrics
        state = self.engine.full_state_dict()
        if self.rollout is not None:
            with self._rollout_paused(version):
                if mode == "collective":
                    self.rollout.update_weights_collective(state, version)
                else:
                    self.rollout.update_weights(state, version)
        return {"weight_sync/bytes": float(sum(t.numel() * t.element_size() for t in state.values()))}

    def _rollout_and_score(self, step: int) -> tuple[TensorBatch | None, dict[str, float]]:
        """Rank 0's part of a step: generation batches (several under dynamic sampling), rewards,
        filters, shaping, advantages (:class:`~core_rl.trainer.batching.BatchAssembler`); the batch
        to train on (``None``: nothing left) and the metrics so far."""
        self._scored_this_step = []
        batch, metrics = self.batcher.assemble(lambda: self._generate_scored(step), step=step)
        metrics["reward/errors_total"] = float(self.reward_log.total)
        assert self.flow is not None
        metrics.update(self.flow.batch_metrics(batch, step))
        if self.reward_stage is None or batch is None:  # else once the reward model has scored (step)
            self._log_samples(step)
        return batch, metrics

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
                with waiting_for(f"the other ranks in the reward-model scores of step {step}"):
                    metrics.update(self.reward_stage.prepare(batch))
                if self.is_main:
                    self._log_samples(step, batch[SCORES].tolist())
            # -- reference / recomputed log-probs, minibatches x epochs: trainer/update.py
            with waiting_for(f"the other ranks in the update of step {step}"):
                update = self.update(batch, train_version=step)
            metrics.update(update)
            actor = {k.removeprefix("actor/"): v for k, v in update.items() if k.startswith("actor/")}
            metrics.update(self.nonfinite.check(step, self._shard(batch), actor))
            metrics["throughput/train_tokens"] = float(batch["attention_mask"].sum()) * self.cfg.algorithm.ppo_epochs
        else:
            metrics["actor/skipped"] = 1.0
        t_sync = time.perf_counter()
        with waiting_for(f"the other ranks in the weight update after step {step}"):
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

    # -- checkpoints --------------------------------------------------------------------------

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
            "reward_errors": self.reward_log.state_dict(),
            "advantage": self.advantage.state_dict() if self.advantage is not None else {},
        }

    def save_checkpoint(self, step: int) -> Path:
        """Save the state after step ``step`` (the step just completed: never another name)."""
        assert self.engine is not None
        if step != self.completed_step:
            raise RuntimeError(f"checkpoint of step {step} asked for after step {self.completed_step}")
        path = checkpoints.checkpoint_dir(self.run_dir, step)
        if self.is_main:  # the rollout engine's state is saved too: its load must be done
            self.weight_load.wait()
        try:
            with waiting_for(f"the other ranks to save checkpoint {path.name}"):
                self.engine.save_state(path, self._extra_state(step))
                save_role_states(self._trained_roles(), path)
            if self.is_main:
                checkpoints.mark_latest(self.run_dir, step)
                checkpoints.prune(self.run_dir, self.cfg.saver.keep_last)
        except Exception as exc:
            if checkpoints.is_disk_full(exc):
                if self.is_main:
                    discard_partial(path)
                raise self._disk_full(f"while saving checkpoint {path} (its partial files were removed)") from exc
            raise
        self.last_saved = step
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
        total = self.cfg.trainer.total_steps
        if found.step > total:
            raise CoreRLError(
                f"trainer.total_steps={total} is below the step of the checkpoint to resume from ({found.path}, "
                f"step {found.step}); raise trainer.total_steps to continue this run, or choose another "
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
        with waiting_for(f"the other ranks to load checkpoint {path.name}"):
            extra = self.engine.load_state(path)
            load_role_states(self._trained_roles(), path)
        step = int(extra["trainer_step"])
        if step != checkpoints.step_of(path):
            raise RunFailed(f"checkpoint {path} holds the state after step {step}, not {checkpoints.step_of(path)}")
        self.start_step = self.completed_step = self.resume_step = step
        self.last_saved = step
        self.data.load_state_dict(extra["data"])
        if self.flow is not None:
            self.flow.load_state_dict(extra.get("controller", {}), step)
        if self.rollout is not None:
            self.rollout.load_state_dict(extra.get("rollout", {}))
        self.nonfinite.load_state_dict(extra.get("nonfinite", {}))
        self.empty_steps.load_state_dict(extra.get("empty_steps", {}))
        self.reward_log.load_state_dict(extra.get("reward_errors", {}))
        if self.advantage is not None:
            self.advantage.load_state_dict(extra.get("advantage", {}))
        with waiting_for("the other ranks to send the resumed weights to the rollout engine"):
            self._sync_weights(step)
        if self.is_main:
            print(f"core-rl: resumed from {path} (step {step})", file=sys.stderr, flush=True)

    # -- the loop -----------------------------------------------------------------------------

    def _interrupted(self, signal_name: str) -> TrainingInterrupted:
        where = checkpoints.checkpoint_dir(self.run_dir, self.last_saved) if self.last_saved else None
        saved = f"checkpoint {where}" if where else "nothing to save yet"
        return TrainingInterrupted(
            f"stopped by {signal_name} after step {self.completed_step} of {self.cfg.trainer.total_steps}; {saved}. "
            "Continue the run with recover.mode=auto (or trainer.resume=true)"
        )

    def run(self) -> dict[str, Any]:
        """Train up to ``trainer.total_steps`` steps; return where the results are."""
        try:
            return self._run()
        except DiskFullError:
            raise
        except Exception as exc:
            if checkpoints.is_disk_full(exc):
                raise self._disk_full(f"({exc})") from exc
            raise

    def _run(self) -> dict[str, Any]:
        assert self.engine is not None
        cfg = self.cfg
        self.maybe_resume()
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
            except Exception as exc:
                error = exc
        try:
            stop = agree_after("starting the loggers (rank 0)", error, self.stop.requested)
            if stop:
                raise self._interrupted(stop)
            for step in range(self.start_step + 1, cfg.trainer.total_steps + 1):
                with self.profiler.around(step):
                    metrics = self.step(step)
                if self.profiler.wants(step):
                    metrics = {**metrics, "profile/active": 1.0}
                self.completed_step = step
                error = None
                if self.is_main:
                    try:
                        for lg in self.loggers:
                            lg.log(metrics, step)
                    except Exception as exc:
                        error = exc
                stop = agree_after(f"step {step}", error, self.stop.requested)
                if (cfg.saver.every_n_steps and step % cfg.saver.every_n_steps == 0) or stop:
                    self.save_checkpoint(step)
                if stop:
                    raise self._interrupted(stop)
            if self.is_main:  # the last version's load: its error belongs to this run
                self.weight_load.wait()
            if cfg.saver.at_end and self.last_saved != self.completed_step:
                self.save_checkpoint(self.completed_step)
            export = None
            if cfg.saver.export_hf:
                export = self.run_dir / "final_hf"
                with waiting_for("the other ranks to export the final model"):
                    self.engine.export_hf(export)
        finally:
            for lg in started:
                lg.close()
        last = checkpoints.checkpoint_dir(self.run_dir, self.last_saved) if self.last_saved else None
        return {
            "run_dir": self.run_dir,
            "metrics": self.run_dir / "metrics.jsonl",
            "checkpoint": last,
            "export": export,
        }

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
    """Check the data, model, machine and output directory (:mod:`core_rl.preflight`), then build a
    trainer for ``cfg`` and run it, restarting after a crash as ``recover`` says
    (:func:`core_rl.trainer.recover.run_with_restarts`); rank 0 prints where metrics and
    checkpoints are."""
    from core_rl.trainer.recover import run_with_restarts

    checked = preflight(cfg)
    result = run_with_restarts(cfg, host, data_rows=checked.rows)
    if rank_and_world()[0] == 0:
        print(f"metrics:    {result['metrics']}")
        at_end = str(cfg.saver.at_end).lower()
        none = f"none saved (saver.every_n_steps={cfg.saver.every_n_steps}, saver.at_end={at_end})"
        print(f"checkpoint: {result['checkpoint'] or none}")
        if result["export"] is not None:
            print(f"model:      {result['export']}")
    return result
