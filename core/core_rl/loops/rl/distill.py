"""On-policy distillation from a teacher (the ``teacher:`` role): the policy loss of any recipe plus
a distillation term on the policy's own samples. With ``teacher.loss: reverse_kl`` (the default) it
is a reverse-KL term on the sampled tokens (:func:`core_rl.ops.reverse_kl_distill_loss`)::

    l_t = rl_coef * (the algorithm's loss)_t + distill_coef * sg(log pi_t - log pi_teacher_t - b) * log pi_t

``teacher_logprobs`` are computed by the teacher engine before the update
(:mod:`core_rl.loops.rl.update`). The baseline ``b`` is the mean of ``old_logprobs -
teacher_logprobs`` over the loss tokens of the whole batch (computed once per RL step in
:meth:`DistillationLoss.prepare`, so the loss does not depend on the split into micro-batches).
The token metric ``distill_kl`` (reported as ``actor/distill_kl``) is the k1 estimate of
KL(pi || pi_teacher) per response token: it falls as the policy learns the teacher.

With ``teacher.loss: topk_forward_kl`` the teacher gives its ``top_k`` most likely tokens per
position (``teacher_topk_ids`` and ``teacher_topk_logprobs`` [B, T, k]), the train engine the
policy's log-probs of those ids (the loss asks for them with ``logprobs_at_key``;
:data:`core_rl.interfaces.LOGPROBS_AT`), and the term is the forward KL over the teacher's top k
(:func:`core_rl.ops.topk_forward_kl_loss`)::

    l_t = rl_coef * (the algorithm's loss)_t + distill_coef * sum_v q_tv (log q_tv - log pi_tv)

``distill_kl`` is then that KL per response token (no baseline: the gradient is exact, not sampled).
"""

from __future__ import annotations

import torch

from core_rl import ops
from core_rl.config.schema import TeacherConfig
from core_rl.config.teacher_checks import TOPK_LOSS
from core_rl.interfaces import LOGPROBS_AT, LossOutput, PolicyLoss
from core_rl.loops.rl.wrapping_loss import WrappingLoss
from core_rl.protocol import TensorBatch

#: the batch key of the teacher's top-k token ids [B, T, k] (their log-probs: ``teacher_topk_logprobs``)
TOPK_IDS = "teacher_topk_ids"


def topk_of(teacher: TeacherConfig | None) -> int | None:
    """The teacher's ``top_k`` where its loss is ``topk_forward_kl``, else ``None``."""
    return teacher.top_k if teacher is not None and teacher.loss == TOPK_LOSS else None


class DistillationLoss(WrappingLoss):
    """Wraps the algorithm's policy loss (``base``) with the distillation term (module docstring);
    aggregation, rejection sampling and what the base needs are the base's."""

    def __init__(self, base: PolicyLoss, teacher: TeacherConfig) -> None:
        super().__init__(base)
        self.rl_coef = teacher.rl_coef
        self.distill_coef = teacher.distill_coef
        self.entropy_grad = self.entropy_grad and self.rl_coef != 0
        self.topk = topk_of(teacher) is not None
        if self.topk:
            if self.logprobs_at_key is not None:  # one set of extra ids per micro-batch
                raise ValueError(
                    f"teacher.loss: {TOPK_LOSS} asks the engine for the log-probs of the teacher's top-k ids, and "
                    f"the algorithm's loss asks for those of batch[{self.logprobs_at_key!r}]; only one can be served"
                )
            #: the engine puts the policy's log-probs of these ids in each micro-batch (``LOGPROBS_AT``)
            self.logprobs_at_key = TOPK_IDS

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        """The base's preparation, and (reverse KL) ``distill_baseline`` [B] (the same value on every row)."""
        if self.topk:
            return self.base.prepare(batch)
        mask = batch["loss_mask"]
        baseline = ops.masked_mean(batch["old_logprobs"] - batch["teacher_logprobs"], mask)
        batch["distill_baseline"] = baseline.expand(batch.batch_size).clone()
        return {**self.base.prepare(batch), "distill_baseline": float(baseline)}

    def has_gradient(self, batch: TensorBatch) -> bool:
        """The distillation term has a gradient unless ``distill_coef`` is 0; the base's term, where
        ``rl_coef`` is not 0 and the base says so."""
        return self.distill_coef != 0 or (self.rl_coef != 0 and self.base.has_gradient(batch))

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        mask = batch["response_mask"]
        if self.topk:
            distill = ops.topk_forward_kl_loss(batch["teacher_topk_logprobs"], batch[LOGPROBS_AT]) * mask
            metrics = {"distill_kl": distill.detach()}
        else:
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
