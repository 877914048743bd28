"""Batch assembly on the main rank, between rewards and the update: sample filters with
over-sampling (dynamic sampling), reward shaping, the loss mask, advantages and their normalisation
(with a reward-model role, shaping and advantages run on every rank after the batch is sent:
:meth:`BatchAssembler.finish_rewards`, called by :mod:`core_rl.loops.rl.reward_model`).

One RL step draws a generation batch (``data.batch_size`` prompts, ``rollout.sampling.n`` samples
each), scores it and filters it. With ``algorithm.max_num_gen_batches`` above 1 it keeps drawing
until the filters have left at least ``data.batch_size`` prompts' groups, then trains on exactly the
first ``data.batch_size`` of them, so the trained batch keeps its configured size whatever the
filters drop (DAPO's dynamic sampling, for any filter). Running out of generation batches first is
a :class:`DynamicSamplingError` naming the setting. What filters see and must keep, and the steps
they leave empty without over-sampling: :mod:`core_rl.loops.rl.filtering`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import attrs
import torch

from core_rl import ops
from core_rl.config.schema import AlgorithmConfig, NormConfig, RewardShapingConfig
from core_rl.errors import CoreRLError
from core_rl.interfaces import AdvantageEstimator, SampleFilter
from core_rl.loops.rl.behave_noise import with_test_noise
from core_rl.loops.rl.filtering import Dropped, EmptySteps, apply_filters, dropped_metrics, named_filters, why_empty
from core_rl.protocol import Sample, TensorBatch, concat_padded, samples_to_batch


class DynamicSamplingError(CoreRLError):
    """The sample filters left too few groups within ``algorithm.max_num_gen_batches`` generation batches."""


@attrs.define
class Generation:
    """One generation batch: its samples in prompt order, the prompt (0-based, within this batch)
    each answers, their raw rewards, metrics to add up over a step's generation batches
    (timings, token counts) and the reward's named parts (``Reward.score_with_parts``), one value per
    sample each. ``where`` (the data row each sample answers, ``file:line``), ``prompt_texts`` and
    ``response_texts`` (as the reward saw them): for the rollout dump, one per sample or empty."""

    samples: list[Sample]
    group_index: list[int]
    rewards: list[float]
    metrics: dict[str, float] = attrs.field(factory=dict)
    reward_parts: dict[str, list[float | None]] = attrs.field(factory=dict)
    where: list[str] = attrs.field(factory=list)
    prompt_texts: list[str] = attrs.field(factory=list)
    response_texts: list[str] = attrs.field(factory=list)


def value_stats(prefix: str, values: Sequence[float | None]) -> dict[str, float]:
    """Mean, std, max and min of the finite ``values``; ``<prefix>/nonfinite`` counts NaN/inf.
    ``None`` (a reward part that does not apply to the sample) is left out of both."""
    present = [v for v in values if v is not None]
    finite = [v for v in present if math.isfinite(v)]
    out = {f"{prefix}/nonfinite": float(len(present) - len(finite))} if len(finite) < len(present) else {}
    if not finite:
        return out
    out.update(
        {
            f"{prefix}/mean": statistics.fmean(finite),
            f"{prefix}/std": statistics.pstdev(finite) if len(finite) > 1 else 0.0,
            f"{prefix}/max": max(finite),
            f"{prefix}/min": min(finite),
        }
    )
    return out


def generation_metrics(generations: Sequence[Generation]) -> dict[str, float]:
    """Reward and response-length statistics over every sample generated in a step (what the policy
    produces, before any filter), and the sums of the generations' own metrics."""
    samples = [s for g in generations for s in g.samples]
    rewards = [r for g in generations for r in g.rewards]
    lengths = [float(len(s.response_ids)) for s in samples]
    metrics = {**value_stats("reward", rewards), **value_stats("response_length", lengths)}
    for name in dict.fromkeys(name for g in generations for name in g.reward_parts):
        values = [v for g in generations for v in g.reward_parts.get(name, [])]
        metrics.update(value_stats(f"reward/{name}", values))
    if samples:
        metrics["response_length/clip_fraction"] = statistics.fmean(s.finish_reason == "length" for s in samples)
    for g in generations:
        for key, value in g.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    return metrics


def normalize_with(values: torch.Tensor, config: NormConfig, group_index: torch.Tensor, mask: torch.Tensor | None):
    """:func:`core_rl.ops.normalize` with the settings of a :class:`NormConfig`."""
    return ops.normalize(values, mask=mask, group_index=group_index, **attrs.asdict(config))


def shape_rewards(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    group_index: torch.Tensor,
    algorithm: AlgorithmConfig,
    *,
    max_new_tokens: int,
) -> torch.Tensor:
    """``algorithm.reward_shaping`` applied to raw rewards ``[B]``: overlong penalty, then
    ``clip((r + bias) * scale)``, then normalisation (see :class:`core_rl.config.schema.RewardShapingConfig`)."""
    cfg = algorithm.reward_shaping
    r = rewards.float()
    if cfg.overlong_tokens is not None:
        r = r + ops.overlong_penalty(
            response_lengths,
            max_new_tokens=max_new_tokens,
            overlong_tokens=cfg.overlong_tokens,
            factor=cfg.overlong_penalty_factor,
        )
    r = ops.scale_rewards(r, scale=cfg.scale, bias=cfg.bias, clip=cfg.clip)
    if cfg.norm is not None:
        r = normalize_with(r, cfg.norm, group_index, None)
    return r


def aggregated_rewards(
    gen: Generation, group_index: torch.Tensor, weights: dict[str, float], shaping: RewardShapingConfig
) -> torch.Tensor:
    """The rewards ``[B]`` of ``aggregation: normalize_then_sum``: :func:`core_rl.ops.normalize_then_sum`
    of the generation's reward parts that ``weights`` names (a ``None`` part, or a generation with
    no parts at all, the reward having failed on every sample, is absent) within the groups of
    ``group_index``; a generation holds whole groups, so this is what the assembled step would
    compute. A generation whose parts are others (a ``rollout.replay_from`` dump of another
    reward) is an error."""
    labels = list(weights)
    missing = [label for label in labels if label not in gen.reward_parts]
    if gen.reward_parts and missing:
        raise CoreRLError(
            f"algorithm.reward_shaping.aggregation: normalize_then_sum sums the parts {', '.join(labels)} of the "
            f"reward, and the scored samples have no part {', '.join(missing)} (they have "
            f"{', '.join(gen.reward_parts)}; a rollout.replay_from dump of another reward?); score them with this "
            "reward, or set algorithm.reward_shaping.aggregation: sum"
        )
    columns = [gen.reward_parts.get(label) or [None] * len(gen.samples) for label in labels]
    parts = torch.tensor([[math.nan if v is None else v for v in column] for column in columns], dtype=torch.float32)
    w = torch.tensor(list(weights.values()), dtype=torch.float32)
    return ops.normalize_then_sum(parts.T, w, group_index, unbiased=shaping.part_unbiased, eps=shaping.part_eps)


def first_groups(group_index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Bool ``[B]``: the rows of the ``n_groups`` smallest group labels (the earliest drawn prompts)."""
    labels = torch.unique(group_index)
    return torch.isin(group_index, labels[:n_groups])


class BatchAssembler:
    """Turns generation batches into the step's training batch (see the module docstring)."""

    def __init__(
        self,
        algorithm: AlgorithmConfig,
        *,
        filters: Sequence[SampleFilter],
        advantage: AdvantageEstimator,
        prompts_per_step: int,
        max_new_tokens: int,
        pad_token_id: int,
        rewards_after_broadcast: bool = False,
        empty_steps: EmptySteps | None = None,
        part_weights: dict[str, float] | None = None,
    ) -> None:
        """``rewards_after_broadcast``: a stage on every rank completes the rewards after the batch
        is sent (a reward model, :mod:`core_rl.loops.rl.reward_model`); the main rank then leaves
        reward shaping and advantages to :meth:`finish_rewards`, which that stage calls.
        ``empty_steps``: the counter of steps left with nothing to train on (the trainer's, kept in
        its checkpoints; default: a new one with ``algorithm.max_consecutive_empty_steps``).
        ``part_weights``: ``label -> weight`` of the reward parts that ``algorithm.reward_shaping.aggregation:
        normalize_then_sum`` sums (:func:`core_rl.config.reward_aggregation.reward_part_weights`);
        ``None``: the reward's score is the reward."""
        self.algorithm = algorithm
        self.rewards_after_broadcast = rewards_after_broadcast
        self.filters = named_filters(filters, algorithm.filters)
        if empty_steps is None:
            empty_steps = EmptySteps(algorithm.max_consecutive_empty_steps)
        self.empty_steps = empty_steps
        self.advantage = advantage
        self.prompts_per_step = prompts_per_step
        self.max_new_tokens = max_new_tokens
        self.pad_token_id = pad_token_id
        self.part_weights = part_weights

    @property
    def dynamic(self) -> bool:
        """Whether the step over-samples to refill what the filters drop."""
        return self.algorithm.max_num_gen_batches > 1

    def _filtered(self, gen: Generation, offset: int) -> tuple[TensorBatch | None, list[Dropped]]:
        """The generation's samples the filters keep (``None`` when it has none left) and what
        each filter dropped."""
        if not gen.samples:
            return None, []
        batch = samples_to_batch(gen.samples, [offset + g for g in gen.group_index], self.pad_token_id)
        batch = with_test_noise(batch)  # a test hook, off unless set (loops/rl/behave_noise.py)
        batch["rewards"] = torch.tensor(gen.rewards, dtype=torch.float32)
        if self.part_weights is not None:  # the reward the advantages read, which the filters judge too
            batch["rewards"] = aggregated_rewards(
                gen, batch["group_index"], self.part_weights, self.algorithm.reward_shaping
            )
        keep, dropped = apply_filters(self.filters, batch, self.algorithm.filter_timeout_s)
        return (batch.rows(keep) if not keep.all() else batch), dropped

    def assemble(
        self, generate: Callable[[], Generation], *, step: int = 0
    ) -> tuple[TensorBatch | None, dict[str, float]]:
        """Draw generation batches from ``generate`` and return the training batch of step
        ``step`` (``None`` when the filters left nothing and over-sampling is off: an empty step,
        see :mod:`core_rl.loops.rl.filtering`) with its metrics."""
        generations: list[Generation] = []
        kept: list[TensorBatch] = []
        dropped: list[Dropped] = []
        offset = 0
        n_groups = 0
        for _ in range(self.algorithm.max_num_gen_batches):
            gen = generate()
            generations.append(gen)
            part, gen_dropped = self._filtered(gen, offset)
            dropped.extend(gen_dropped)
            offset += max(gen.group_index, default=-1) + 1
            if part is not None and part.batch_size:
                kept.append(part)
                n_groups += int(torch.unique(part["group_index"]).numel())
            if not self.dynamic or n_groups >= self.prompts_per_step:
                break
        metrics = generation_metrics(generations)
        n_generated = sum(len(g.samples) for g in generations)
        n_kept = sum(b.batch_size for b in kept)
        metrics["filter/kept_fraction"] = n_kept / max(n_generated, 1)
        metrics.update(dropped_metrics(dropped, n_generated))
        if self.dynamic:
            metrics["dynamic_sampling/gen_batches"] = float(len(generations))
            if n_groups < self.prompts_per_step:
                raise DynamicSamplingError(
                    f"dynamic sampling: after {len(generations)} generation batches "
                    f"(algorithm.max_num_gen_batches={self.algorithm.max_num_gen_batches}) the sample filters left "
                    f"{n_groups} of the data.batch_size={self.prompts_per_step} prompts' groups a step trains on; "
                    "raise algorithm.max_num_gen_batches, or loosen algorithm.filters"
                )
        why = None if kept else why_empty(dropped, n_generated, metrics.get("reward/dropped", 0.0))
        metrics.update(self.empty_steps.check(step, why))
        if not kept:
            return None, metrics
        batch = concat_padded(kept, self.pad_token_id)
        if self.dynamic:
            batch = batch.rows(first_groups(batch["group_index"], self.prompts_per_step))
        return self._finish(batch, metrics)

    def _finish(self, batch: TensorBatch, metrics: dict[str, float]) -> tuple[TensorBatch, dict[str, float]]:
        """Loss mask, then (unless ``rewards_after_broadcast``) :meth:`finish_rewards`."""
        mask = batch["response_mask"]
        loss_mask = mask.clone()
        if self.algorithm.mask_no_eos_with_zero:
            loss_mask = loss_mask * (~batch["truncated"]).float()[:, None]
        batch["loss_mask"] = loss_mask
        metrics.update(
            {
                "batch/groups": float(torch.unique(batch["group_index"]).numel()),
                "batch/samples": float(batch.batch_size),
                "batch/loss_token_fraction": float(loss_mask.sum() / mask.sum().clamp(min=1)),
            }
        )
        if self.rewards_after_broadcast:
            batch["advantages"] = torch.zeros_like(loss_mask)  # set by finish_rewards on every rank
        else:
            metrics.update(self.finish_rewards(batch))
        return batch, metrics

    def finish_rewards(self, batch: TensorBatch) -> dict[str, float]:
        """Shape ``rewards`` (:func:`shape_rewards`; under ``aggregation: normalize_then_sum`` they are
        :func:`aggregated_rewards` already) and set ``advantages`` (normalised by
        ``algorithm.adv_norm``) of a batch with ``loss_mask``; return their metrics. An estimator
        needing a critic's values or reference log-probs runs in the update instead
        (:func:`runs_in_update`)."""
        algorithm = self.algorithm
        mask, loss_mask = batch["response_mask"], batch["loss_mask"]
        batch["rewards"] = shape_rewards(
            batch["rewards"], mask.sum(dim=1), batch["group_index"], algorithm, max_new_tokens=self.max_new_tokens
        )
        in_update = runs_in_update(self.advantage)
        advantages = torch.zeros_like(loss_mask) if in_update else self.advantage(batch)
        if algorithm.adv_norm is not None and not in_update:
            advantages = normalize_with(advantages, algorithm.adv_norm, batch["group_index"], loss_mask)
        batch["advantages"] = advantages
        return {
            "batch/reward_mean": float(batch["rewards"].mean()),
            "advantage/mean": float(ops.masked_mean(advantages, loss_mask)),
        }


def runs_in_update(advantage: AdvantageEstimator) -> bool:
    """Whether ``advantage`` runs in the update, on every rank, after the reference log-probs (and a
    critic's values) are in the batch (:func:`set_advantages`), rather than on the main rank
    when the batch is assembled: it declares ``requires_values`` or ``requires_reference`` (e.g. a
    KL penalty in its reward, :mod:`core_rl.ops.kl_reward`)."""
    return bool(getattr(advantage, "requires_values", False) or getattr(advantage, "requires_reference", False))


def set_advantages(
    batch: TensorBatch, advantages: torch.Tensor, advantage: AdvantageEstimator, algorithm: AlgorithmConfig
) -> dict[str, float]:
    """Set ``advantages`` of a global batch in the update from what ``advantage`` (an estimator that
    :func:`runs_in_update`) returned for it, normalised by ``algorithm.adv_norm`` over the
    ``loss_mask``. Returns ``advantage/mean`` and the estimator's own ``metrics()`` as
    ``advantage/...`` (e.g. ``kl_coef``, ``kl_in_reward`` of a KL penalty in the reward)."""
    loss_mask = batch["loss_mask"]
    if algorithm.adv_norm is not None:
        advantages = normalize_with(advantages, algorithm.adv_norm, batch["group_index"], loss_mask)
    batch["advantages"] = advantages
    metrics = {"advantage/mean": float(ops.masked_mean(advantages, loss_mask))}
    metrics.update({f"advantage/{k}": v for k, v in getattr(advantage, "metrics", dict)().items()})
    return metrics
