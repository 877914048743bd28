"""The critic in the update of one RL step (PPO), on every rank with the same global batch.

1. :meth:`CriticStage.prepare`: the critic's values ``V_old`` of the batch (computed on the shards,
   gathered), then the advantage estimator (e.g. GAE, which needs values) sets ``advantages`` and
   ``returns``; ``algorithm.adv_norm`` normalises the advantages. The main rank's batch assembly
   skipped the estimator for this (:mod:`core_rl.loops.rl.batching`).
2. The policy trains on those advantages (:mod:`core_rl.loops.rl.update`), except during the
   critic's ``warmup_steps`` first RL steps.
3. :meth:`CriticStage.update`: the same minibatches x epochs of value steps on the clipped value
   loss (:func:`core_rl.ops.value_loss`), averaged over the loss tokens of each minibatch.

Checkpoints: the critic's training state is saved in ``<checkpoint>/critic`` (atomically, by its
engine) after the actor's; a checkpoint without a complete critic state is not resumable
(:func:`check_role_states`), so a crash between the two falls back to the previous checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from core_rl import ops
from core_rl.config.schema import AlgorithmConfig, CriticConfig, RunConfig
from core_rl.interfaces import AdvantageEstimator, LossOutput, TrainEngine
from core_rl.loops.rl.batching import set_advantages
from core_rl.loops.rl.update import Shard, combine_step_metrics, compute_on_shards
from core_rl.plugins.guards import engine_metrics, engine_tensor
from core_rl.protocol import TensorBatch

#: the subdirectory of a checkpoint holding the critic's training state
CRITIC_DIR = "critic"


class CriticStage:
    """Values, advantages and value updates of one RL step (see the module docstring)."""

    @classmethod
    def of_run(
        cls, cfg: RunConfig, critic: TrainEngine | None, advantage: AdvantageEstimator, shard: Shard, world_size: int
    ) -> CriticStage | None:
        """The stage of a run whose ``critic`` role was built (``None``: the run has no critic)."""
        if critic is None:
            return None
        assert cfg.critic is not None
        return cls(
            critic=critic,
            config=cfg.critic,
            advantage=advantage,
            algorithm=cfg.algorithm,
            shard=shard,
            world_size=world_size,
        )

    def __init__(
        self,
        *,
        critic: TrainEngine,
        config: CriticConfig,
        advantage: AdvantageEstimator,
        algorithm: AlgorithmConfig,
        shard: Shard,
        world_size: int,
    ) -> None:
        self.critic = critic
        self.config = config
        self.advantage = advantage
        self.algorithm = algorithm
        self.shard = shard
        self.world_size = world_size

    def warming_up(self, train_version: int) -> bool:
        """Whether the RL step producing weight version ``train_version`` trains the critic alone."""
        return train_version <= self.config.warmup_steps

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        """Set ``values`` (the critic's, before this step's update), ``advantages`` and ``returns``."""
        values = functools.partial(engine_tensor, self.critic, "compute_values", "values")
        compute_on_shards(batch, self.shard, self.world_size, {"values": values})
        mask = batch["response_mask"]
        batch["values"] = batch["values"] * mask
        advantages = self.advantage(batch)
        if "returns" not in batch:
            batch["returns"] = (advantages + batch["values"]) * mask
        metrics = set_advantages(batch, advantages, self.advantage, self.algorithm)
        metrics["critic/values_mean"] = float(ops.masked_mean(batch["values"], mask))
        metrics["critic/returns_mean"] = float(ops.masked_mean(batch["returns"], mask))
        explained = _explained_variance(batch["values"], batch["returns"], mask)
        if explained is not None:
            metrics["critic/explained_variance"] = explained
        return metrics

    def loss(self, batch: TensorBatch, values: torch.Tensor) -> LossOutput:
        """The clipped value loss per token (``critic.eps_clip``, ``critic.loss``), against ``returns``
        with the values before the update (``values`` in the batch) as the clipping centre."""
        cfg = self.config
        per_token, clipped = ops.value_loss(
            values, batch["values"], batch["returns"], eps_clip=cfg.eps_clip, loss=cfg.loss, huber_delta=cfg.huber_delta
        )
        return LossOutput(per_token_loss=per_token, token_metrics={"value_clipped": clipped.float()})

    def update(self, batch: TensorBatch, parts: Sequence[torch.Tensor]) -> dict[str, float]:
        """``algorithm.ppo_epochs`` passes over the minibatch rows ``parts``, one value step each."""
        steps = []
        for _epoch in range(self.algorithm.ppo_epochs):
            for rows in parts:
                minibatch = batch.rows(rows)
                minibatch["loss_weight"] = ops.aggregation_weights(minibatch["loss_mask"], "token-mean")
                steps.append(engine_metrics(self.critic, "train_value_step", self.shard(minibatch), self.loss))
        metrics = {f"critic/{k}": v for k, v in combine_step_metrics(steps).items()}
        metrics["critic/optimizer_steps"] = float(len(steps))
        return metrics


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float | None:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens (``None`` when ``Var(R)`` is 0)."""
    on = mask != 0
    if int(on.sum()) < 2:
        return None
    r, v = returns[on].double(), values[on].double()
    var = float(r.var())
    return None if var == 0 else 1.0 - float((r - v).var()) / var


def save_role_states(roles: dict[str, TrainEngine], path: Path, *, optimizer: bool = True) -> None:
    """Save each trained role's state under ``path/<role>`` (collective; atomic per role), its
    optimizer state unless ``optimizer`` is false (``saver.save_optimizer``)."""
    for name, engine in roles.items():
        engine.save_state(path / name, {}, optimizer=optimizer)


def check_role_states(roles: dict[str, TrainEngine], path: Path) -> None:
    """Raise :class:`~core_rl.checkpoint.files.CheckpointFormatError` unless every trained role's state
    under ``path`` is complete."""
    for name, engine in roles.items():
        engine.check_checkpoint(path / name)


def load_role_states(roles: dict[str, TrainEngine], path: Path, *, optimizer: bool = True) -> None:
    """Restore each trained role's state from ``path/<role>`` (collective), with a fresh optimizer
    when ``optimizer`` is false (``recover.load_optimizer``)."""
    for name, engine in roles.items():
        engine.load_state(path / name, optimizer=optimizer)
