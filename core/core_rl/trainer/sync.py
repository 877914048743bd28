"""The synchronous RL loop.

One step: prompts -> rollout (n samples each) -> rewards -> sample filters -> advantages and loss
weights -> (reference log-probs) -> one optimiser step -> weights to the rollout engine -> metrics to
every logger -> checkpoint on the saver's schedule.

Under ``torchrun`` every rank runs this loop with its own train-engine shard; rank 0 alone owns the
rollout engine, rewards and loggers, and broadcasts each step's batch to the other ranks, which take
every ``world_size``-th row.
"""

from __future__ import annotations

import random
import statistics
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
    RolloutEngine,
    RunInfo,
    SampleFilter,
    TrainEngine,
)
from core_rl.kinds import (
    ADVANTAGE,
    LOGGER,
    POLICY_LOSS,
    REWARD,
    ROLLOUT_ENGINE,
    SAMPLE_FILTER,
    TRAIN_ENGINE,
    PluginKind,
)
from core_rl.plugins import PluginHost
from core_rl.protocol import RewardInput, Sample, TensorBatch, samples_to_batch
from core_rl.trainer import checkpoints
from core_rl.trainer.data import PromptItem, PromptSource


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


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}/mean": statistics.fmean(values),
        f"{prefix}/std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        f"{prefix}/max": max(values),
        f"{prefix}/min": min(values),
    }


class SyncTrainer:
    """Builds every component a :class:`RunConfig` selects and runs the synchronous loop."""

    def __init__(self, cfg: RunConfig, host: PluginHost) -> None:
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

        _quiet_library_progress_bars()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor.tokenizer_path or cfg.actor.model_path)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        self.sampling = cfg.rollout.sampling.to_params()

        # every rank reads the data (only rank 0 draws from it) so a bad file fails on all ranks
        # at once instead of leaving the others waiting in a collective
        self.data = PromptSource(cfg.data, self.tokenizer, seed=seed)
        self.rollout: RolloutEngine | None = None
        self.reward: Reward | None = None
        self.loggers: list[Logger] = []
        if self.is_main:
            self.rollout = host.get(ROLLOUT_ENGINE, cfg.rollout.engine.name).factory(
                cfg.rollout, cfg.rollout.engine.config, model_path=cfg.actor.model_path, run_dir=self.run_dir
            )
            self.reward = _build(host, REWARD, cfg.reward)
            specs = list(cfg.loggers)
            if not any(s.name == "jsonl" for s in specs):  # every run leaves its metrics file
                specs.append(PluginSpec(name="jsonl", config=host.get(LOGGER, "jsonl").config_cls()))
            self.loggers = [_build(host, LOGGER, s) for s in specs]
        self.start_step = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

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

    def _score(self, samples: list[Sample], owners: list[PromptItem]) -> list[float]:
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
        scores = self.reward.score(inputs)
        if len(scores) != len(inputs):
            raise RuntimeError(
                f"reward {self.cfg.reward.name!r} returned {len(scores)} scores for {len(inputs)} samples"
            )
        return [float(x) for x in scores]

    def _prepare_batch(
        self, samples: list[Sample], group_index: list[int], rewards: list[float]
    ) -> tuple[TensorBatch | None, dict[str, float]]:
        batch = samples_to_batch(samples, group_index, self.pad_token_id)
        batch["rewards"] = torch.tensor(rewards, dtype=torch.float32)
        keep = torch.ones(batch.batch_size, dtype=torch.bool)
        for f in self.filters:
            keep &= f(batch)
        metrics = {"filter/kept_fraction": keep.float().mean().item()}
        if not keep.any():
            return None, metrics
        if not keep.all():
            batch = batch.rows(keep)
        batch["advantages"] = self.advantage(batch)
        batch["loss_weight"] = self.loss.loss_weights(batch["response_mask"])
        mask = batch["response_mask"]
        metrics["advantage/mean"] = float((batch["advantages"] * mask).sum() / mask.sum().clamp(min=1))
        return batch, metrics

    def _sync_weights(self, version: int) -> dict[str, float]:
        """Move the policy's weights to the rollout engine; return ``weight_sync/bytes``."""
        mode = self.cfg.rollout.weight_sync
        if mode == "disk":
            path = self.run_dir / "weight_sync"
            self.engine.export_hf(path)
            if self.rollout is not None:
                self.rollout.load_weights_from_path(path, version)
            return {"weight_sync/bytes": float(sum(f.stat().st_size for f in path.glob("*.safetensors")))}
        state = self.engine.full_state_dict()
        if self.rollout is not None:
            if mode == "collective":
                self.rollout.update_weights_collective(state, version)
            else:
                self.rollout.update_weights(state, version)
        return {"weight_sync/bytes": float(sum(t.numel() * t.element_size() for t in state.values()))}

    def step(self, step: int) -> dict[str, float]:
        """Run RL step ``step`` (1-based) and return its metrics (complete on rank 0)."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        payload: tuple[TensorBatch | None, dict[str, float]] | None = None
        if self.is_main:
            prompts = self.data.next_batch()
            samples, group_index, owners = self._rollout(prompts)
            t_gen = time.perf_counter()
            rewards = self._score(samples, owners)
            t_reward = time.perf_counter()
            lengths = [float(len(s.response_ids)) for s in samples]
            metrics.update(_stats("reward", rewards))
            metrics.update(_stats("response_length", lengths))
            metrics["response_length/clip_fraction"] = statistics.fmean(
                1.0 if s.finish_reason == "length" else 0.0 for s in samples
            )
            metrics["timing/generate_s"] = t_gen - t0
            metrics["timing/reward_s"] = t_reward - t_gen
            metrics["throughput/generated_tokens_per_s"] = sum(lengths) / max(t_gen - t0, 1e-9)
            payload = self._prepare_batch(samples, group_index, rewards)
        batch, prep_metrics = _broadcast(payload, self.rank, self.world_size)
        metrics.update(prep_metrics)
        t_train = time.perf_counter()
        if batch is not None:
            shard = batch.rows(slice(self.rank, None, self.world_size))
            if self.ref is not None:
                shard["ref_logprobs"] = self.ref.compute_logprobs(shard, temperature=self.sampling.temperature)
            actor = self.engine.train_step(shard, self.loss, temperature=self.sampling.temperature)
            metrics.update({f"actor/{k}": v for k, v in actor.items()})
            metrics["throughput/train_tokens"] = float(batch["attention_mask"].sum())
        else:
            metrics["actor/skipped"] = 1.0
        t_sync = time.perf_counter()
        metrics.update(self._sync_weights(step))
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
        for component in (self.rollout, self.ref, self.engine):
            if component is not None:
                component.close()


def train(cfg: RunConfig, *, host: PluginHost) -> Mapping[str, Any]:
    """Build a trainer for ``cfg`` and run it; rank 0 prints where metrics and checkpoints are."""
    trainer = SyncTrainer(cfg, host)
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
