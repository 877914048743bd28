"""Which tokens ``ppo_clip``'s ``loss_mode: clip_cov | kl_cov`` act on (Cui et al. 2025), chosen
once per RL step on the whole global batch in :meth:`PPOClipLoss.prepare
<core_rl_grpo.losses.PPOClipLoss.prepare>`.

Scope. The covariance ``cov_t = (A_t - mean A) (log pi_old_t - mean log pi_old)`` is centred over
every loss token of the step's global batch (``loss_mask``, after M2PO), with ``old_logprobs`` (the
policy the step starts from, equal to the current policy at the step's first forward pass) and the
advantages the loss sees; ``k = max(1, floor(ratio * N))`` of its ``N`` loss tokens are selected
(``ratio = 0``: none). The selection is stored in the batch as ``cov_selected`` ([B, T] float, 1 on
the selected tokens) and travels with the rows, so the loss, and its gradient, do not depend on how
the batch is cut into minibatches, micro-batches or data-parallel ranks, and every epoch over the
batch uses the same tokens. (verl selects per micro-batch, with the current log-probs, each time
the loss runs: its selection depends on the micro-batch size; with one micro-batch, one rank and
one on-policy update the two agree.)

Determinism. Clip-Cov's random draw uses a CPU generator seeded from the step
(``seed = SEED_SALT + train_version``) only: ``prepare`` runs on the same global batch on every
rank, so every rank draws the same tokens without a rank term, and a resumed run redraws exactly
the tokens the uninterrupted run drew at that step.
"""

from __future__ import annotations

import torch
from core_rl import ops
from core_rl.protocol import TensorBatch

from core_rl_grpo.config import PPOClipConfig

#: added to the step (``train_version``) to seed Clip-Cov's generator
SEED_SALT = 0x5EED_C0F


def step_generator(train_version: int) -> torch.Generator:
    """The CPU generator of Clip-Cov's draw at the update producing ``train_version``."""
    return torch.Generator().manual_seed(SEED_SALT + int(train_version))


def select_tokens(batch: TensorBatch, advantages: torch.Tensor, config: PPOClipConfig) -> dict[str, float]:
    """Set ``batch["cov_selected"]`` for ``config.loss_mode`` (``clip_cov`` or ``kl_cov``) and return
    metrics: ``cov_selected_fraction`` (of the loss tokens) and ``cov_mean`` (the batch covariance)."""
    mask = batch["loss_mask"]
    cov = ops.token_covariance(batch["old_logprobs"].to(advantages.dtype), advantages, mask)
    if config.loss_mode == "clip_cov":
        generator = step_generator(int(batch["train_version"][0]))
        selected = ops.clip_cov_select(
            cov.cpu(),
            mask.cpu(),
            ratio=config.clip_cov_ratio,
            low=config.clip_cov_lb,
            high=config.clip_cov_ub,
            generator=generator,
        ).to(mask.device)
    else:
        selected = ops.kl_cov_select(cov, mask, ratio=config.kl_cov_ratio)
    batch["cov_selected"] = selected.to(mask.dtype)
    n = mask.sum().clamp(min=1)
    return {
        "cov_selected_fraction": float(selected.sum() / n),
        "cov_mean": float(ops.masked_mean(cov, mask)),
    }
