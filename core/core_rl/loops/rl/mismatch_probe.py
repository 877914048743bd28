"""The train/rollout mismatch of a step whose update does not recompute ``old_logprobs``
(:mod:`core_rl.ops.mismatch` has the formulas).

Without a recompute (on-policy GRPO, the default) the trainer's own log-probs of the batch under
the weights that the samples came from appear once anyway: in the forward passes of the update's
first optimiser step, before its weights change. :class:`MismatchProbe` wraps the policy loss for
that one step and adds up, micro-batch by micro-batch, the mismatch of those log-probs against
``behave_logprobs`` over the ``loss_mask`` tokens; :meth:`MismatchProbe.collect` sums over ranks.
No extra forward pass, but only the first minibatch's rows are measured (all of them with
``ppo_n_minibatches: 1``). A first step that skips its forward pass (a zero-signal step,
:mod:`core_rl.loops.rl.update`) or an update with no actor step (the critic warming up) is measured
by :meth:`MismatchProbe.measure_by_forward` instead: one forward pass over the first minibatch's rows.
"""

from __future__ import annotations

import time

import torch

from core_rl import ops
from core_rl.interfaces import LossOutput, PolicyLoss, TrainEngine
from core_rl.launch.distributed import summed_over_ranks
from core_rl.loops.rl.wrapping_loss import WrappingLoss
from core_rl.plugins.guards import engine_tensor
from core_rl.protocol import TensorBatch

#: the order of the summed values (:func:`core_rl.ops.mismatch_sums`)
SUM_KEYS = (*ops.MISMATCH_METRICS, "tokens")


class MismatchProbe(WrappingLoss):
    """``base`` unchanged (its per-token loss and token metrics), and this rank's sums of the
    mismatch of every micro-batch's log-probs against its ``behave_logprobs`` on ``loss_mask``."""

    def __init__(self, base: PolicyLoss, ratio_bound: float) -> None:
        super().__init__(base)
        self.ratio_bound = ratio_bound
        self.sums = dict.fromkeys(SUM_KEYS, 0.0)
        #: this rank's time spent measuring (``timing/mismatch_s``)
        self.seconds = 0.0

    def has_gradient(self, batch: TensorBatch) -> bool:
        return self.base.has_gradient(batch)

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        if "behave_logprobs" in batch:
            start = time.perf_counter()
            mask = batch.get("loss_mask", batch["response_mask"])
            for key, value in ops.mismatch_sums(logprobs, batch["behave_logprobs"], mask, self.ratio_bound).items():
                self.sums[key] += value
            self.seconds += time.perf_counter() - start
        return self.base(batch, logprobs, entropy)

    def measure_by_forward(self, engine: TrainEngine, shard: TensorBatch, temperature: float) -> None:
        """Measure this rank's ``shard`` with log-probs from one forward pass of ``engine`` (no
        gradient), in place of a train step's. Collective where the engine's forward is."""
        start = time.perf_counter()
        logprobs = engine_tensor(engine, "compute_logprobs", "recomputed log-probs", shard, temperature=temperature)
        mask = shard.get("loss_mask", shard["response_mask"])
        self.sums = ops.mismatch_sums(logprobs, shard["behave_logprobs"], mask, self.ratio_bound)
        self.seconds += time.perf_counter() - start

    def collect(self) -> dict[str, float]:
        """The means over every rank's measured tokens (:func:`core_rl.ops.means_of_sums`).
        Collective: every rank calls it once for the same step."""
        return ops.means_of_sums(dict(zip(SUM_KEYS, summed_over_ranks([self.sums[k] for k in SUM_KEYS]))))
