"""Online DPO as an advantage estimator: each prompt's samples are ranked by their rewards, the
best is the chosen response and the worst the rejected one, and the advantages are those whose
policy gradient is the gradient of a preference loss on that pair (:mod:`core_rl.ops.preference`).

With the sequence log-ratios ``r = sum_t (log pi_old(y_t) - log pi_ref(y_t))`` over the loss tokens
(``old_logprobs`` recomputed by the trainer, as for every estimator that reads the reference), a
pair's loss ``L(r_w, r_l)`` and ``P`` pairs in the batch, the DPO gradient is
``(1/P) sum_p [dL/dr_w grad log pi(y_w) + dL/dr_l grad log pi(y_l)]``. A policy-gradient loss at
ratio 1 with ``seq-mean-token-sum`` aggregation over the batch's ``B`` rows has the gradient
``-(1/B) sum_i A_i grad log pi(y_i)``, so every token of the chosen response gets
``A = -(B/P) dL/dr_w``, of the rejected ``A = -(B/P) dL/dr_l``, and every other row 0: the
unpaired samples of groups of more than two, and the groups whose best and worst rewards are equal
(no preference; counted in ``ties``), which so neither dilute nor enlarge the step.
The ``online_dpo`` recipe pairs it with ``ppo_clip`` at ``seq-mean-token-sum``, one optimiser step
per RL step: that step's gradient is then exactly DPO's at the rollout policy. (With another
aggregation, or several minibatches, each step follows the same advantages with other weights.)
``algorithm.adv_norm`` is refused: it would give the unpaired rows advantages.
"""

from __future__ import annotations

import torch
from core_rl import ops
from core_rl.interfaces import AdvantageEstimator
from core_rl.protocol import TensorBatch

from core_rl_grpo.config import OnlineDPOAdvantageConfig


def best_and_worst(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (in the order of :func:`core_rl.ops.group_ids_to_dense`), the row of its highest
    and of its lowest reward; the first such row on a tie within the group."""
    dense, n_groups = ops.group_ids_to_dense(group_index)
    rows = torch.arange(rewards.numel())
    best, worst = torch.empty(n_groups, dtype=torch.long), torch.empty(n_groups, dtype=torch.long)
    for g in range(n_groups):
        members = rows[dense == g]
        values = rewards[members]
        best[g] = members[int(torch.argmax(values))]
        worst[g] = members[int(torch.argmin(values))]
    return best, worst


class OnlineDPOAdvantage(AdvantageEstimator):
    """See the module docstring. Reads ``rewards``, ``group_index``, ``loss_mask``,
    ``old_logprobs`` and ``ref_logprobs``."""

    requires_reference = True

    def __init__(self, config: OnlineDPOAdvantageConfig) -> None:
        self.config = config
        self._metrics: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        """Of the last call: the pairs' implicit-reward ``accuracy`` (``r_w > r_l``), mean
        ``margin`` ``beta (r_w - r_l)``, mean preference ``loss``, and ``ties`` (groups left out)."""
        return dict(self._metrics)

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        cfg = self.config
        mask = batch["loss_mask"].to(torch.float64)
        logratio = ((batch["old_logprobs"].double() - batch["ref_logprobs"].double()) * mask).sum(dim=1)
        rewards = batch["rewards"].double()
        best, worst = best_and_worst(rewards, batch["group_index"])
        paired = rewards[best] > rewards[worst]
        best, worst = best[paired], worst[paired]
        r_w = logratio[best].clone().requires_grad_(True)
        r_l = logratio[worst].clone().requires_grad_(True)
        losses = ops.preference_loss(
            r_w,
            r_l,
            loss_type=cfg.loss_type,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            discopop_tau=cfg.discopop_tau,
        )
        advantages = torch.zeros_like(mask)
        if best.numel():
            grad_w, grad_l = torch.autograd.grad(losses.sum(), (r_w, r_l))
            scale = rewards.numel() / best.numel()  # B / P
            per_row = torch.zeros_like(rewards)
            per_row[best], per_row[worst] = -scale * grad_w, -scale * grad_l
            advantages = per_row[:, None] * mask
        margin = cfg.beta * (r_w - r_l).detach()
        self._metrics = {
            "ties": float((~paired).sum()),
            **(
                {
                    "accuracy": float((margin > 0).double().mean()),
                    "margin": float(margin.mean()),
                    "loss": float(losses.detach().mean()),
                }
                if best.numel()
                else {}
            ),
        }
        return advantages.to(batch["loss_mask"].dtype if batch["loss_mask"].is_floating_point() else torch.float32)
