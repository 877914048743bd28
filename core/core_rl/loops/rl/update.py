"""The policy update of one RL step, on every rank: reference, teacher and recomputed log-probs,
the critic's values and advantages (with a critic, :mod:`core_rl.loops.rl.critic`), the loss's
whole-batch preparation, then ``ppo_n_minibatches`` optimiser steps per epoch for ``ppo_epochs``
epochs (none while the critic warms up), then the critic's own steps over the same minibatches.

Zero-signal steps: an optimiser step whose loss cannot have a gradient (the loss's
:meth:`~core_rl.interfaces.PolicyLoss.has_gradient` is ``False``: under GRPO without KL or entropy
terms, a minibatch whose groups all scored alike, every advantage 0) skips its forward and backward
passes over the minibatch. It still takes the optimiser step a zero gradient gives (AdamW decays its
moments, counts the step, applies weight decay and moves the weights by its momentum; the learning
rate schedule advances), through the engine's own :meth:`~core_rl.interfaces.TrainEngine.train_step`
on one two-token row per rank whose loss is exactly 0 with a zero gradient reaching every parameter
(:func:`zero_gradient_step`), so the weights and optimiser state are bitwise those of the full step.
Not with ``algorithm.early_stop_kl`` (each step's measured KL decides the next). The step reports
``loss``, ``grad_norm`` (both 0), ``lr`` and ``nonfinite`` only: no ``entropy`` or token metrics
of a batch it did not see.

The train/rollout mismatch (``mismatch/*``, :mod:`core_rl.ops.mismatch`) is reported every update:
from the recomputed ``old_logprobs`` when there are some (:func:`drift_metrics`), else from the
log-probs of the first optimiser step (:mod:`core_rl.loops.rl.mismatch_probe`).

Log-probs are computed on each rank's shard and gathered back into the global batch, so everything
that looks at the whole batch (the loss's :meth:`~core_rl.interfaces.PolicyLoss.prepare`, each
minibatch's aggregation weights) sees the same data on every rank, whatever the number of ranks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from core_rl import ops
from core_rl.config.schema import AlgorithmConfig
from core_rl.interfaces import AdvantageEstimator, LossOutput, PolicyLoss, TrainEngine
from core_rl.loops.errors import RunFailed
from core_rl.loops.rl.batching import runs_in_update, set_advantages
from core_rl.loops.rl.mismatch_probe import MismatchProbe
from core_rl.loops.rl.ptx import PTXRows, with_ptx
from core_rl.loops.step_metrics import MAX_SUFFIX
from core_rl.loops.streaks import StreakCounter
from core_rl.plugins.guards import engine_metrics, engine_tensor, engine_topk
from core_rl.protocol import TensorBatch

#: (global batch) -> this rank's rows of it
Shard = Callable[[TensorBatch], TensorBatch]

ROW_ID = "_row_id"


class CriticSteps(Protocol):
    """What the update asks of a critic (:class:`core_rl.loops.rl.critic.CriticStage`)."""

    def warming_up(self, train_version: int) -> bool:
        """Whether the step producing ``train_version`` trains the critic alone."""

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        """Set ``values``, ``advantages`` and ``returns`` of ``batch``; their metrics."""

    def update(self, batch: TensorBatch, parts: Sequence[torch.Tensor]) -> dict[str, float]:
        """The critic's optimiser steps over the minibatch rows ``parts``; their metrics."""


def minibatch_rows(n_rows: int, n_minibatches: int) -> list[torch.Tensor]:
    """Row indices of each minibatch: ``0..n_rows-1`` cut into ``n_minibatches`` consecutive parts of
    sizes differing by at most one (empty parts are left out)."""
    return [rows for rows in torch.arange(n_rows).tensor_split(n_minibatches) if rows.numel()]


def combine_step_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Metrics of several optimiser steps as one: the maximum of ``*_max`` metrics, the mean of the rest."""
    names = sorted({k for s in steps for k in s})
    out = {}
    for name in names:
        values = [s[name] for s in steps if name in s]
        out[name] = max(values) if name.endswith(MAX_SUFFIX) else sum(values) / len(values)
    return out


def _gather_rows(batch: TensorBatch, shard: TensorBatch, keys: Sequence[str], world_size: int) -> None:
    """Write ``shard[key]`` of every rank's shard into ``batch[key]`` at the shards' row ids."""
    if world_size == 1:
        for key in keys:
            batch[key] = shard[key].new_zeros(batch[ROW_ID].shape + shard[key].shape[1:])
            batch[key][shard[ROW_ID]] = shard[key]
        return
    import torch.distributed as dist

    parts: list[dict[str, torch.Tensor] | None] = [None] * world_size
    dist.all_gather_object(parts, {k: shard[k].cpu() for k in (ROW_ID, *keys)})
    for key in keys:
        full = shard[key].new_zeros(batch[ROW_ID].shape + shard[key].shape[1:]).cpu()
        for part in parts:
            assert part is not None
            full[part[ROW_ID]] = part[key]
        batch[key] = full


#: (this rank's shard) -> a tensor, or several named ones
ShardFn = Callable[[TensorBatch], "torch.Tensor | dict[str, torch.Tensor]"]


def compute_on_shards(batch: TensorBatch, shard: Shard, world_size: int, compute: dict[str, ShardFn]) -> None:
    """For each ``key -> fn``: ``batch[key] = fn(this rank's shard)`` (a ``fn`` that returns a dict
    sets each of its keys instead), gathered from every rank's shard into the global batch (the
    same on every rank). Collective."""
    if not compute:
        return
    batch[ROW_ID] = torch.arange(batch.batch_size)
    part = shard(batch)
    keys = []
    for key, fn in compute.items():
        out = fn(part)
        named = out if isinstance(out, dict) else {key: out}
        for name, value in named.items():
            part[name] = value
        keys += list(named)
    _gather_rows(batch, part, keys, world_size)
    del batch.data[ROW_ID]


def drift_metrics(batch: TensorBatch, ratio_bound: float) -> dict[str, float]:
    """How far the recomputed ``old_logprobs`` (pi_old) are from the behaviour log-probs over the
    loss tokens: the train/rollout mismatch ``mismatch/*`` of :func:`core_rl.ops.mismatch_means`
    (``|log pi_old - log pi_behave|``, the k3 estimate of KL(pi_behave || pi_old), the share of
    ratios outside ``[1 / ratio_bound, ratio_bound]``), mean and max of ``pi_old / pi_behave``,
    the same KL as ``offpolicy/kl_behave_old``, and the staleness of the samples in weight
    versions (``train_version - 1 - versions``)."""
    mask = batch["loss_mask"]
    on = mask != 0
    if not bool(on.any()):
        return {}
    mismatch = ops.mismatch_means(batch["old_logprobs"], batch["behave_logprobs"], mask, ratio_bound)
    log_ratio = ops.behaviour_log_ratio(batch["old_logprobs"], batch["behave_logprobs"])
    staleness = (batch["train_version"][:, None] - 1 - batch["versions"]).float()
    return {
        **{f"mismatch/{k}": v for k, v in mismatch.items()},
        "offpolicy/behave_ratio_mean": float(ops.masked_mean(log_ratio.exp(), mask)),
        "offpolicy/behave_ratio_max": float(log_ratio.exp()[on].max()),
        "offpolicy/kl_behave_old": mismatch["kl_behave_trainer"],
        "offpolicy/staleness_mean": float(ops.masked_mean(staleness, mask)),
        "offpolicy/staleness_max": float(staleness[on].max()),
    }


def over_kl(step: dict[str, float], limit: float) -> bool:
    """Whether an optimiser step's ``approx_kl`` exceeds ``algorithm.early_stop_kl`` (the same on
    every rank: engine metrics are reduced over ranks). A loss that reports none is a
    :class:`~core_rl.loops.errors.RunFailed` naming the key."""
    if "approx_kl" not in step:
        raise RunFailed(
            "algorithm.early_stop_kl: the policy loss reports no approx_kl metric to stop on (ppo_clip does); "
            "remove early_stop_kl, or use a loss that reports it"
        )
    return step["approx_kl"] > limit


class ZeroLoss:
    """``per_token_loss = logprobs * 0``: exactly 0 on every token, its gradient zero tensors that
    reach every parameter the log-probs depend on (not none: an optimiser skips a parameter without
    one). The entropy is a metric only."""

    entropy_grad = False

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        return LossOutput(per_token_loss=logprobs * 0.0)


#: the metrics a zero-gradient step reports: what the skipped step would have (the rest describe the row it ran)
ZERO_STEP_METRICS = ("loss", "grad_norm", "lr", "nonfinite")


def zero_gradient_rows(pad_token_id: int) -> TensorBatch:
    """One row of two ``pad_token_id`` tokens, the second a response token with aggregation weight
    0: the smallest batch whose log-probs depend on the weights (the first token has none)."""
    response = torch.tensor([[0.0, 1.0]])
    return TensorBatch(
        {
            "input_ids": torch.full((1, 2), pad_token_id, dtype=torch.long),
            "attention_mask": torch.ones((1, 2), dtype=torch.long),
            "response_mask": response,
            "loss_mask": response.clone(),
            "loss_weight": torch.zeros_like(response),
        }
    )


def zero_gradient_step(engine: TrainEngine, pad_token_id: int, temperature: float) -> dict[str, float]:
    """The optimiser step a zero gradient gives, through ``engine.train_step`` on
    :func:`zero_gradient_rows` (this rank's rows) with :class:`ZeroLoss`; its
    :data:`ZERO_STEP_METRICS`. Collective: every rank calls it for the same step."""
    step = engine_metrics(engine, "train_step", zero_gradient_rows(pad_token_id), ZeroLoss(), temperature=temperature)
    return {k: step[k] for k in ZERO_STEP_METRICS if k in step}


def no_signal_warning(
    step: int, streak: int, metrics: Mapping[str, float], *, after: int, max_new_tokens: int
) -> str | None:
    """The warning (``trainer.warn_no_signal_steps``) when step ``step`` makes ``after`` updates in
    a row (``streak``) that carried no learning signal (every optimiser step zero-signal: every
    group's samples scored alike, every advantage 0, the policy unchanged but for the optimiser's
    momentum); ``None`` otherwise (also with ``after`` 0), so one warning per such streak. What it
    says of the cause comes from the step's ``metrics``: every sample's reward equal or not
    (``reward/min``, ``reward/max``), and the share of responses cut at ``max_new_tokens``
    (``response_length/clip_fraction``)."""
    if after == 0 or streak != after:
        return None
    low, high = metrics.get("reward/min"), metrics.get("reward/max")
    if low is not None and low == high:
        scored = f"every sample of step {step} scored {low:g}"
    else:
        scored = f"in each group of step {step} the samples scored alike"
    steps = f"step {step}" if streak == 1 else f"steps {step - streak + 1}-{step}"
    head = f"{steps}: no learning signal: {scored}, so every advantage was 0"
    clipped = metrics.get("response_length/clip_fraction", 0.0)
    if clipped >= 0.5:
        cause = (
            f"{clipped:.0%} of its responses were cut at rollout.sampling.max_new_tokens ({max_new_tokens}): "
            "raise it so that answers can end"
        )
    else:
        cause = (
            "check on a few scored samples (sample_log) that the reward reads the answers as intended; for a task "
            "too hard or too easy for the model, raise rollout.sampling.n or choose prompts of its level"
        )
    return f"{head}; {cause} (trainer.warn_no_signal_steps: {after}; 0 turns this off)"


class PolicyUpdate:
    """Runs the update of one RL step; every rank calls it with the same global batch.

    ``shard`` picks this rank's rows of a batch (the same rule for every call).
    """

    def __init__(
        self,
        *,
        engine: TrainEngine,
        ref: TrainEngine | None,
        loss: PolicyLoss,
        algorithm: AlgorithmConfig,
        temperature: float,
        shard: Shard,
        world_size: int,
        teacher: TrainEngine | None = None,
        teacher_top_k: int | None = None,
        student_vocab: int | None = None,
        critic: CriticSteps | None = None,
        advantage: AdvantageEstimator | None = None,
    ) -> None:
        """``advantage``: the run's estimator; one that :func:`~core_rl.loops.rl.batching.runs_in_update`
        without a critic sets the batch's advantages here, after the log-probs (with a critic,
        ``critic.prepare`` runs it after the values). ``teacher_top_k``: the teacher gives its
        ``teacher_topk_ids`` and ``teacher_topk_logprobs`` [B, T, k] in place of ``teacher_logprobs``
        (``teacher.loss: topk_forward_kl``), among the policy's first ``student_vocab`` tokens (``None``: all
        of the teacher's; the trainer sets the shared tokenizer's length, bounded by the actor's
        embedding: a teacher's padded embedding may exceed the policy's, whose log-probs are then
        gathered at those ids)."""
        self.engine = engine
        self.ref = ref
        self.teacher = teacher
        self.teacher_top_k = teacher_top_k
        self.student_vocab = student_vocab
        self.critic = critic
        self.advantage = advantage if advantage is not None and runs_in_update(advantage) else None
        self.loss = loss
        self.algorithm = algorithm
        self.temperature = temperature
        self.shard = shard
        self.world_size = world_size
        # a KL penalty in the reward measures KL(pi_old || pi_ref) with the trainer's own forward on
        # both sides (the rollout engine's log-probs would add its numerical gap to the KL)
        self.kl_in_reward = self.advantage is not None and bool(getattr(self.advantage, "requires_reference", False))
        #: ``algorithm.ptx``'s rows (:mod:`core_rl.loops.rl.ptx`), set once the tokenizer is loaded
        self.ptx: PTXRows | None = None
        #: the padding token (of ptx rows and the zero-gradient row), set once the tokenizer is loaded
        self.pad_token_id = 0
        #: updates whose every optimiser step was zero-signal (``total`` kept in checkpoints)
        self.zero_signal = StreakCounter()

    @property
    def recompute(self) -> bool:
        """Whether this step's update recomputes ``old_logprobs`` with the train engine; read at
        every step, since the loss's need may change (a rejection sampler turned on by
        ``algorithm.mismatch_budget``'s ``correct``)."""
        return self.algorithm.recompute_logprob or self.loss.requires_recompute or self.kl_in_reward

    def _logprobs(self, batch: TensorBatch) -> None:
        """``ref_logprobs`` (with a reference model), ``teacher_logprobs`` (with a teacher; its top-k
        ids and log-probs with ``teacher_top_k``) and recomputed ``old_logprobs`` (when asked),
        computed on the shards and gathered into ``batch``."""
        compute: dict[str, ShardFn] = {}
        topk = self.teacher_top_k is not None
        for key, engine, what in (
            ("ref_logprobs", self.ref, "reference log-probs"),
            ("teacher_logprobs", None if topk else self.teacher, "teacher log-probs"),
            ("old_logprobs", self.engine if self.recompute else None, "recomputed log-probs"),
        ):
            if engine is not None:
                compute[key] = functools.partial(
                    engine_tensor, engine, "compute_logprobs", what, temperature=self.temperature
                )
        if topk and self.teacher is not None:
            compute["teacher_topk"] = functools.partial(
                engine_topk,
                self.teacher,
                k=self.teacher_top_k,
                temperature=self.temperature,
                vocab_size=self.student_vocab,
            )
        compute_on_shards(batch, self.shard, self.world_size, compute)

    def __call__(self, batch: TensorBatch, *, train_version: int) -> dict[str, float]:
        """Update the policy on ``batch`` (a global batch with ``loss_mask`` and ``advantages``);
        ``train_version`` is the weight version the update produces. Returns metrics, among them
        ``actor/zero_signal_steps`` (the optimiser steps taken without their forward and backward
        passes, module docstring), ``actor/zero_signal_update`` (1.0 when every one of at least one
        step was) and ``actor/zero_signal_updates_total`` (such updates in the run so far)."""
        batch["train_version"] = torch.full((batch.batch_size,), train_version, dtype=torch.long)
        start = time.perf_counter()
        self._logprobs(batch)
        bound = self.algorithm.mismatch_budget.ratio_bound
        metrics = drift_metrics(batch, bound) if self.recompute else {}
        metrics["timing/logprobs_s"] = time.perf_counter() - start
        if self.critic is not None:  # values, then advantages from them (loops/rl/critic.py)
            metrics.update(self.critic.prepare(batch))
        elif self.advantage is not None:  # e.g. a KL penalty in the reward, on the reference log-probs
            metrics.update(set_advantages(batch, self.advantage(batch), self.advantage, self.algorithm))
        metrics.update({f"actor/{k}": v for k, v in self.loss.prepare(batch).items()})
        steps = []
        parts = minibatch_rows(batch.batch_size, self.algorithm.ppo_n_minibatches)
        train_actor = self.critic is None or not self.critic.warming_up(train_version)
        epochs = self.algorithm.ppo_epochs if train_actor else 0
        stopped = False
        skipped = 0
        # without a recompute, the mismatch is measured in the first optimiser step (loops/rl/mismatch_probe.py)
        probe = None if self.recompute else MismatchProbe(self.loss, bound)
        for i, rows in enumerate(rows for _epoch in range(epochs) for rows in parts):
            minibatch = batch.rows(rows)
            minibatch["loss_weight"] = self.loss.loss_weights(minibatch["loss_mask"])
            if self.ptx is not None:
                minibatch = with_ptx(minibatch, self.ptx.next_rows(), self.ptx.config.coef, self.pad_token_id)
            loss = probe if probe is not None and i == 0 else self.loss
            if self.algorithm.early_stop_kl is None and not self.loss.has_gradient(minibatch):
                if probe is not None and i == 0:  # before the zero-gradient step moves the weights
                    probe.measure_by_forward(self.engine, self.shard(minibatch), self.temperature)
                steps.append(zero_gradient_step(self.engine, self.pad_token_id, self.temperature))
                skipped += 1
                continue
            shard = self.shard(minibatch)
            step = engine_metrics(self.engine, "train_step", shard, loss, temperature=self.temperature)
            steps.append({**step, **self.loss.observe_step(step)})
            if self.algorithm.early_stop_kl is not None and over_kl(step, self.algorithm.early_stop_kl):
                stopped = True
                break
        if probe is not None:
            if epochs == 0:  # no actor step (the critic warms up): one forward pass over the first minibatch
                probe.measure_by_forward(self.engine, self.shard(batch.rows(parts[0])), self.temperature)
            metrics.update({f"mismatch/{k}": v for k, v in probe.collect().items()})
            metrics["timing/mismatch_s"] = probe.seconds
        metrics.update({f"actor/{k}": v for k, v in combine_step_metrics(steps).items()})
        metrics["actor/optimizer_steps"] = float(len(steps))
        whole = bool(steps) and skipped == len(steps)
        self.zero_signal.count(whole)
        metrics["actor/zero_signal_steps"] = float(skipped)
        metrics["actor/zero_signal_update"] = float(whole)
        metrics["actor/zero_signal_updates_total"] = float(self.zero_signal.total)
        if self.algorithm.early_stop_kl is not None:
            metrics["actor/early_stopped"] = float(stopped)
        if self.critic is not None:
            metrics.update(self.critic.update(batch, parts))
        # the optimizer step's kernels end here, as training's time, not the weight sync's (in an asynchronous
        # run with the rollout engine on this device this also waits for its few queued decoding kernels)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return metrics
