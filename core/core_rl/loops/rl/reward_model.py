"""The ``reward_model:`` role in the RL step: a frozen reward model (a backbone with a scalar
``score`` head, :mod:`core_rl.roles.build`) scores every sample on the token ids of this run, on every
rank, after the main rank has sent the step's batch.

The main rank generates, scores with the ``reward:`` section (0 for every sample without one) and
assembles the batch, leaving reward shaping and advantages out
(:class:`~core_rl.loops.rl.batching.BatchAssembler` with ``rewards_after_broadcast``); the synchronous
loop and the rollout controller (asynchronous runs) share that path. Then, on every rank,
:meth:`RewardModelStage.prepare`:

1. each rank scores its shard's rows (:func:`~core_rl.loops.rl.update.compute_on_shards`, the
   critic's mechanism), gathered into the global batch as ``reward_model_scores`` ``[B]``;
2. ``rewards = rule + coef * transform(score)`` (``reward_model.coef``, ``reward_model.transform``);
3. :meth:`~core_rl.loops.rl.batching.BatchAssembler.finish_rewards`: reward shaping and advantages,
   exactly as the main rank does without a reward model (an estimator needing a critic's values
   still runs in the update).

Sample filters and dynamic sampling run on the main rank before step 1, so they are refused with a
reward model (:func:`core_rl.roles.build.role_problems`).

Where the score is read (``reward_model.score_token``): the output of the score head at token ``k``
of the row, ``k`` being the last response token (``last``) or the last response token that is not a
special token of the tokenizer or a configured stop token (``last_content``: a trailing EOS is
skipped; how the ``rm`` loop trains and how the ``reward_model`` reward reads decoded text). A row
without such a response token is read at the token before its response. The engine's values are
aligned like log-probs (position ``t`` holds the output at ``t - 1``), so the score is
``values[k + 1]``; where ``k`` is the row's last token, one slot column (the pad id, attended to) is
appended after it. The model is causal: its output at ``k`` does not depend on the slot or on
later tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from core_rl.config.schema import RewardModelRoleConfig, RunConfig
from core_rl.interfaces import Reward, TrainEngine
from core_rl.loops.rl.batching import BatchAssembler, value_stats
from core_rl.loops.rl.update import Shard, compute_on_shards
from core_rl.protocol import RewardInput, TensorBatch

#: the batch key of the reward model's scores ``[B]`` (after ``transform``, before ``coef``)
SCORES = "reward_model_scores"


class NoRuleReward(Reward):
    """The main rank's reward when a run has a ``reward_model:`` section but no ``reward:``: 0 for
    every sample (the reward model's score is then the whole reward)."""

    def score(self, items: Sequence[RewardInput]) -> list[float]:
        return [0.0] * len(items)


def score_token_index(batch: TensorBatch, *, score_token: str, special_ids: Sequence[int]) -> torch.Tensor:
    """``[B]`` long: the index of the token whose output is each row's score (module docstring) in
    a right-padded batch with ``input_ids``, ``attention_mask`` and ``response_mask``."""
    ids, response = batch["input_ids"], batch["response_mask"] != 0
    lengths = batch["attention_mask"].sum(1)
    positions = torch.arange(ids.shape[1])
    start = torch.where(response.any(1), response.float().argmax(1), lengths)  # the first response token
    if score_token == "last":
        return lengths - 1
    content = (positions >= start[:, None]) & (positions < lengths[:, None])
    content &= ~torch.isin(ids, torch.tensor(sorted(set(special_ids)), dtype=ids.dtype))
    last = torch.where(content, positions, -1).amax(1)
    return torch.where(last >= 0, last, (start - 1).clamp(min=0))


def slot_layout(batch: TensorBatch, index: torch.Tensor, pad_token_id: int) -> TensorBatch:
    """``input_ids`` / ``attention_mask`` one column wider, with the slot after each row whose
    score token ``index`` is its last token (attended to), so that ``values[index + 1]`` exists."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    rows = ids.shape[0]
    wide_ids = torch.cat([ids, ids.new_full((rows, 1), pad_token_id)], dim=1)
    wide_attention = torch.cat([attention, attention.new_zeros((rows, 1))], dim=1)
    lengths = attention.sum(1)
    needs_slot = index == lengths - 1
    wide_attention[needs_slot.nonzero().squeeze(1), lengths[needs_slot]] = 1
    return TensorBatch({"input_ids": wide_ids, "attention_mask": wide_attention})


class RewardModelStage:
    """Reward-model scores, final rewards and advantages of one RL step (module docstring)."""

    def __init__(
        self,
        *,
        engine: TrainEngine,
        config: RewardModelRoleConfig,
        batcher: BatchAssembler,
        shard: Shard,
        world_size: int,
        special_ids: Sequence[int],
        pad_token_id: int,
        rule_reward: bool,
    ) -> None:
        """``special_ids``: the token ids ``last_content`` skips; ``rule_reward``: whether the run
        has a ``reward:`` section (its scores are then reported as ``reward/rule/*``)."""
        self.engine = engine
        self.config = config
        self.batcher = batcher
        self.shard = shard
        self.world_size = world_size
        self.special_ids = list(special_ids)
        self.pad_token_id = pad_token_id
        self.rule_reward = rule_reward

    def scores(self, part: TensorBatch) -> torch.Tensor:
        """``[b]``: the reward model's score of each row of ``part`` (after ``transform``)."""
        index = score_token_index(part, score_token=self.config.score_token, special_ids=self.special_ids)
        values = self.engine.compute_values(slot_layout(part, index, self.pad_token_id))
        scores = values[torch.arange(part.batch_size), index + 1].float()
        return torch.sigmoid(scores) if self.config.transform == "sigmoid" else scores

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        """Score ``batch`` (the global batch, the same on every rank; collective), add ``coef`` times
        the scores to ``rewards``, then shape them and set ``advantages``. Returns the metrics:
        ``reward/reward_model/*`` (the scores), ``reward/rule/*`` (the ``reward:`` section's, when
        set), ``reward/*`` (the sum, replacing the main rank's), ``timing/reward_model_s`` and
        :meth:`~core_rl.loops.rl.batching.BatchAssembler.finish_rewards`'s."""
        start = time.perf_counter()
        compute_on_shards(batch, self.shard, self.world_size, {SCORES: self.scores})
        rule = batch["rewards"].float()
        batch["rewards"] = rule + self.config.coef * batch[SCORES]
        metrics = {
            **value_stats("reward", batch["rewards"].tolist()),
            **value_stats("reward/reward_model", batch[SCORES].tolist()),
            **(value_stats("reward/rule", rule.tolist()) if self.rule_reward else {}),
        }
        metrics.update(self.batcher.finish_rewards(batch))
        metrics["timing/reward_model_s"] = time.perf_counter() - start
        return metrics


def reward_model_stage(
    engine: TrainEngine | None,
    cfg: RunConfig,
    batcher: BatchAssembler,
    shard: Shard,
    world_size: int,
    tokenizer: Any,
    pad_token_id: int,
) -> RewardModelStage | None:
    """The stage of a run's reward-model role (``None`` without one); ``tokenizer``: the actor's,
    whose special tokens (and ``rollout.sampling.stop_token_ids``) ``last_content`` skips."""
    if engine is None or cfg.reward_model is None:
        return None
    return RewardModelStage(
        engine=engine,
        config=cfg.reward_model,
        batcher=batcher,
        shard=shard,
        world_size=world_size,
        special_ids=[*getattr(tokenizer, "all_special_ids", []), *cfg.rollout.sampling.stop_token_ids],
        pad_token_id=pad_token_id,
        rule_reward=cfg.reward is not None,
    )
