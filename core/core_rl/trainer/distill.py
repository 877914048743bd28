"""On-policy distillation from a teacher (the ``teacher:`` role): the policy loss of any recipe plus
a reverse-KL term on the policy's own samples (:func:`core_rl.ops.reverse_kl_distill_loss`)::

    l_t = rl_coef * (the algorithm's loss)_t + distill_coef * sg(log pi_t - log pi_teacher_t - b) * log pi_t

``teacher_logprobs`` are computed by the teacher engine before the update
(:mod:`core_rl.trainer.update`). The baseline ``b`` is the mean of ``old_logprobs -
teacher_logprobs`` over the loss tokens of the whole batch (computed once per RL step in
:meth:`DistillationLoss.prepare`, so the loss does not depend on the split into micro-batches).
The token metric ``distill_kl`` (reported as ``actor/distill_kl``) is the k1 estimate of
KL(pi || pi_teacher) per response token: it falls as the policy learns the teacher.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from core_rl import ops
from core_rl.config.schema import TeacherConfig
from core_rl.interfaces import LossOutput, PolicyLoss, RejectionSampler
from core_rl.protocol import TensorBatch


class DistillationLoss(PolicyLoss):
    """Wraps the algorithm's policy loss (``base``) with the distillation term (module docstring);
    aggregation, preparation, rejection sampling and what the base needs are the base's."""

    def __init__(self, base: PolicyLoss, teacher: TeacherConfig) -> None:
        self.base = base
        self.rl_coef = teacher.rl_coef
        self.distill_coef = teacher.distill_coef
        self.requires_reference = base.requires_reference
        self.requires_recompute = base.requires_recompute
        self.entropy_grad = getattr(base, "entropy_grad", True) and self.rl_coef != 0

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        return self.base.loss_weights(response_mask)

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        """The base's preparation, and ``distill_baseline`` [B] (the same value on every row)."""
        mask = batch["loss_mask"]
        baseline = ops.masked_mean(batch["old_logprobs"] - batch["teacher_logprobs"], mask)
        batch["distill_baseline"] = baseline.expand(batch.batch_size).clone()
        return {**self.base.prepare(batch), "distill_baseline": float(baseline)}

    def set_rejection_sampler(self, sampler: RejectionSampler | None) -> None:
        self.base.set_rejection_sampler(sampler)

    def observe_step(self, metrics: Mapping[str, float]) -> dict[str, float]:
        return self.base.observe_step(metrics)

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.base.load_state_dict(state)

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        mask = batch["response_mask"]
        teacher = batch["teacher_logprobs"]
        baseline = batch["distill_baseline"][:, None] if "distill_baseline" in batch else 0.0
        distill = ops.reverse_kl_distill_loss(logprobs, teacher, baseline) * mask
        metrics = {"distill_kl": ((logprobs - teacher).detach() * mask)}
        if self.rl_coef == 0:
            return LossOutput(per_token_loss=self.distill_coef * distill, token_metrics=metrics)
        out = self.base(batch, logprobs, entropy)
        return LossOutput(
            per_token_loss=self.rl_coef * out.per_token_loss + self.distill_coef * distill,
            token_metrics={**out.token_metrics, **metrics},
        )
