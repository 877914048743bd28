"""The synchronous RL loop.

One step: prompts -> rollout (n samples each) -> rewards -> sample filters (drawing more prompts
while they leave too few groups) -> reward shaping, advantages (:mod:`core_rl.trainer.batching`) ->
(reference / recomputed log-probs) -> optimiser steps over minibatches and epochs
(:mod:`core_rl.trainer.update`) -> weights to the rollout engine -> metrics to every logger ->
checkpoint on the saver's schedule.

Under ``torchrun`` every rank runs this loop with its own train-engine shard; rank 0 alone owns the
rollout engine, rewards and loggers, and broadcasts each step's batch to the other ranks, which take
every ``world_size``-th row.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from core_rl.config.loader import to_plain
from core_rl.config.schema import PluginSpec, RunConfig
from core_rl.errors import CoreRLError
from core_rl.interfaces import (
    AdvantageEstimator,
    Logger,
    PolicyLoss,
    Reward,
    RewardScores,
    RolloutEngine,
    RunInfo,
    SampleFilter,
    SampleRecord,
    TrainEngine,
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
    PluginKind,
)
from core_rl.plugins import PluginHost
from core_rl.preflight import preflight
from core_rl.protocol import RewardInput, Sample, TensorBatch
from core_rl.trainer import checkpoints
from core_rl.trainer.batching import BatchAssembler, Generation
from core_rl.trainer.data import DataRow, PromptItem, PromptSource
from core_rl.trainer.update import PolicyUpdate


def _build(host: PluginHost, kind: PluginKind, spec: PluginSpec) -> Any:
    """Build a component whose factory takes its validated section (``None`` without options)."""
    return host.get(kind, spec.name).factory(spec.config)


def _quiet_library_progress_bars() -> None:
    """The console logger is the run's progress bar; silence the per-load bars of libraries."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(obj: Any, rank: int, world_size: int) -> Any:
    if world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class SyncTrainer:
    """Builds every component a :class:`RunConfig` selects and runs the synchronous loop."""

    def __init__(self, cfg: RunConfig, host: PluginHost, data_rows: list[DataRow] | None = None) -> None:
        self.cfg = cfg
        self.host = host
        seed = cfg.experiment.seed
        if cfg.trainer.torch_threads:
            torch.set_num_threads(cfg.trainer.torch_threads)
        random.seed(seed)
        torch.manual_seed(seed)
        self.run_dir = Path(cfg.experiment.output_dir) / cfg.experiment.name
        if not cfg.trainer.resume and (self.run_dir / "metrics.jsonl").exists():
            raise CoreRLError(
                f"run directory {self.run_dir} already holds a run; set trainer.resume=true to continue it, "
                "or choose another experiment.name"
            )

        assert cfg.algorithm.loss is not None and cfg.algorithm.advantage is not None and cfg.reward is not None
        self.loss: PolicyLoss = _build(host, POLICY_LOSS, cfg.algorithm.loss)
        self.advantage: AdvantageEstimator = _build(host, ADVANTAGE, cfg.algorithm.advantage)
        self.filters: list[SampleFilter] = [_build(host, SAMPLE_FILTER, s) for s in cfg.algorithm.filters]
        engine_entry = host.get(TRAIN_ENGINE, cfg.actor.engine.name)
        self.engine: TrainEngine = engine_entry.factory(cfg.actor, cfg.actor.engine.config, trainable=True)
        self.ref: TrainEngine | None = None
        if self.loss.requires_reference:
            self.ref = engine_entry.factory(cfg.actor, cfg.actor.engine.config, trainable=False)
        self.rank, self.world_size = _dist()
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
        )
        # ----------------------------------------------------------------------------------------

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
        )

        # every rank reads the data (only rank 0 draws from it) so a bad file fails on all ranks
        # at once instead of leaving the others waiting in a collective
        self.data = PromptSource(cfg.data, self.tokenizer, seed=seed, rows=data_rows)
        self.rollout: RolloutEngine | None = None
        self.reward: Reward | None = None
        self.loggers: list[Logger] = []
        if self.is_main:
            self.rollout = host.get(ROLLOUT_ENGINE, cfg.rollout.engine.name).factory(
                cfg.rollout, cfg.rollout.engine.config, model_path=cfg.actor.model_path
            )
            self.reward = _build(host, REWARD, cfg.reward)
            specs = list(cfg.loggers)
            if not any(s.name == "jsonl" for s in specs):  # every run leaves its metrics file
                specs.append(PluginSpec(name="jsonl", config=host.get(LOGGER, "jsonl").config_cls()))
            self.loggers = [_build(host, LOGGER, s) for s in specs]
        self.start_step = 0
        # (reward inputs, scores) of each generation batch of the current step, for sample logging
        self._scored_this_step: list[tuple[list[RewardInput], RewardScores]] = []

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _shard(self, batch: TensorBatch) -> TensorBatch:
        """This rank's rows of a global batch."""
        return batch.rows(slice(self.rank, None, self.world_size))

    # -- one step -----------------------------------------------------------------------------

    def _rollout(self, prompts: list[PromptItem]) -> tuple[list[Sample], list[int], list[PromptItem]]:
        assert self.rollout is not None
        groups = self.rollout.generate([p.prompt_ids for p in prompts], self.sampling)
        samples, group_index, owners = [], [], []
        for g, (prompt, group) in enumerate(zip(prompts, groups)):
            for sample in group:
                samples.append(sample)
                group_index.append(g)
                owners.append(prompt)
        return samples, group_index, owners

    def _score(self, samples: list[Sample], owners: list[PromptItem]) -> tuple[list[RewardInput], RewardScores]:
        assert self.reward is not None
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        inputs = [
            RewardInput(
                prompt_text=owner.text,
                response_text=text,
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                row=owner.row,
                finish_reason=s.finish_reason,
            )
            for s, text, owner in zip(samples, texts, owners)
        ]
        scored = self.reward.score_with_parts(inputs)
        if len(scored.scores) != len(inputs):
            raise RuntimeError(
                f"reward {self.cfg.reward.name!r} returned {len(scored.scores)} scores for {len(inputs)} samples"
            )
        scored.scores = [float(x) for x in scored.scores]
        return inputs, scored

    def _log_samples(self, step: int) -> None:
        """Every ``sample_log.every_n_steps`` steps, hand ``num_samples`` samples spread over the
        step's first generation batch to every logger."""
        if not self._scored_this_step:
            return
        inputs, scored = self._scored_this_step[0]
        every, k = self.cfg.sample_log.every_n_steps, min(self.cfg.sample_log.num_samples, len(inputs))
        if not every or step % every or not k:
            return
        records = [
            SampleRecord(
                prompt=inputs[i].prompt_text,
                response=inputs[i].response_text,
                reward=scored.scores[i],
                finish_reason=inputs[i].finish_reason,
                parts={name: float(values[i]) for name, values in scored.parts.items()},
            )
            for i in sorted({j * len(inputs) // k for j in range(k)})
        ]
        for lg in self.loggers:
            lg.log_samples(records, step)

    def _generate_scored(self) -> Generation:
        """One generation batch: the next prompts, their samples and rewards, with timings."""
        t0 = time.perf_counter()
        prompts = self.data.next_batch()
        samples, group_index, owners = self._rollout(prompts)
        t_gen = time.perf_counter()
        inputs, scored = self._score(samples, owners)
        self._scored_this_step.append((inputs, scored))
        t_reward = time.perf_counter()
        timings = {
            "timing/generate_s": t_gen - t0,
            "timing/reward_s": t_reward - t_gen,
            "throughput/generated_tokens": float(sum(len(s.response_ids) for s in samples)),
        }
        return Generation(
            samples=samples,
            group_index=group_index,
            rewards=scored.scores,
            metrics=timings,
            reward_parts={name: [float(v) for v in values] for name, values in scored.parts.items()},
        )

    def _sync_weights(self, version: int) -> None:
        if self.cfg.rollout.weight_sync == "disk":
            path = self.run_dir / "weight_sync"
            self.engine.export_hf(path)
            if self.rollout is not None:
                self.rollout.load_weights_from_path(path, version)
            return
        state = self.engine.full_state_dict()
        if self.rollout is not None:
            self.rollout.update_weights(state, version)

    def step(self, step: int) -> dict[str, float]:
        """Run RL step ``step`` (1-based) and return its metrics (complete on rank 0)."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        payload: tuple[TensorBatch | None, dict[str, float]] | CoreRLError | None = None
        if self.is_main:
            # -- generation, rewards, filters (over-sampling), shaping, advantages: trainer/batching.py
            self._scored_this_step = []
            try:
                payload = self.batcher.assemble(self._generate_scored)
            except CoreRLError as exc:  # every rank raises it, none is left waiting
                payload = exc
            self._log_samples(step)
        payload = _broadcast(payload, self.rank, self.world_size)
        if isinstance(payload, CoreRLError):
            raise payload
        batch, prep_metrics = payload
        metrics.update(prep_metrics)
        generated = metrics.pop("throughput/generated_tokens", 0.0)
        metrics["throughput/generated_tokens_per_s"] = generated / max(metrics.get("timing/generate_s", 0.0), 1e-9)
        t_train = time.perf_counter()
        if batch is not None:
            # -- reference / recomputed log-probs, minibatches x epochs: trainer/update.py
            metrics.update(self.update(batch, train_version=step))
            metrics["throughput/train_tokens"] = float(batch["attention_mask"].sum()) * self.cfg.algorithm.ppo_epochs
        else:
            metrics["actor/skipped"] = 1.0
        t_sync = time.perf_counter()
        self._sync_weights(step)
        t_end = time.perf_counter()
        metrics["timing/train_s"] = t_sync - t_train
        metrics["timing/weight_sync_s"] = t_end - t_sync
        metrics["timing/step_s"] = t_end - t0
        metrics["weight_version"] = float(step)
        if "throughput/train_tokens" in metrics:
            metrics["throughput/tokens_per_s"] = metrics.pop("throughput/train_tokens") / max(t_end - t0, 1e-9)
        return metrics

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        path = checkpoints.checkpoint_dir(self.run_dir, step)
        extra = {"trainer_step": step, "data": self.data.state_dict()}
        self.engine.save_state(path, extra)
        if self.is_main:
            checkpoints.mark_latest(self.run_dir, step)
            checkpoints.prune(self.run_dir, self.cfg.saver.keep_last)
        return path

    def maybe_resume(self) -> None:
        if not self.cfg.trainer.resume:
            return
        found = checkpoints.latest_checkpoint(self.run_dir)
        path = _broadcast(str(found) if found else None, self.rank, self.world_size)
        if path is None:
            return
        extra = self.engine.load_state(path)
        self.start_step = int(extra["trainer_step"])
        self.data.load_state_dict(extra["data"])
        self._sync_weights(self.start_step)

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train for ``trainer.total_steps`` steps; return where the results are."""
        cfg = self.cfg
        self.maybe_resume()
        info = RunInfo(name=cfg.experiment.name, output_dir=self.run_dir, config=to_plain(cfg))
        for lg in self.loggers:
            lg.start(info)
        last_ckpt: Path | None = None
        try:
            for step in range(self.start_step + 1, cfg.trainer.total_steps + 1):
                metrics = self.step(step)
                for lg in self.loggers:
                    lg.log(metrics, step)
                if cfg.saver.every_n_steps and step % cfg.saver.every_n_steps == 0:
                    last_ckpt = self.save_checkpoint(step)
            final = cfg.trainer.total_steps
            if cfg.saver.at_end and (last_ckpt is None or last_ckpt != checkpoints.checkpoint_dir(self.run_dir, final)):
                last_ckpt = self.save_checkpoint(final)
            export = None
            if cfg.saver.export_hf:
                export = self.run_dir / "final_hf"
                self.engine.export_hf(export)
        finally:
            for lg in self.loggers:
                lg.close()
        return {
            "run_dir": self.run_dir,
            "metrics": self.run_dir / "metrics.jsonl",
            "checkpoint": last_ckpt,
            "export": export,
        }

    def close(self) -> None:
        for component in (self.rollout, self.ref, self.engine, self.reward):
            if component is not None:
                component.close()


def train(cfg: RunConfig, *, host: PluginHost) -> Mapping[str, Any]:
    """Check the data, model, machine and output directory (:mod:`core_rl.preflight`), then build a
    trainer for ``cfg`` and run it; rank 0 prints where metrics and checkpoints are."""
    checked = preflight(cfg)
    trainer = SyncTrainer(cfg, host, data_rows=checked.rows)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    if trainer.is_main:
        print(f"metrics:    {result['metrics']}")
        print(f"checkpoint: {result['checkpoint']}")
        if result["export"] is not None:
            print(f"model:      {result['export']}")
    return result
