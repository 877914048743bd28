"""The train/rollout mismatch: how far the trainer's log-probs of the sampled tokens are from the
behaviour log-probs the rollout engine reported for them (``algorithm.mismatch_budget``).

With ``d_t = log pi_train(y_t) - log pi_behave(y_t)`` and ``r_t = exp(d_t)`` on a token ``t``:

- ``abs_logprob_diff``:      ``|d_t|``
- ``kl_behave_trainer``:     ``r_t - 1 - d_t``, the k3 estimate of KL(pi_behave || pi_train) from
                             the behaviour policy's samples (:func:`core_rl.ops.kl_estimate`, uncapped)
- ``ratio_out_of_bounds``:   ``1`` where ``r_t < 1 / bound`` or ``r_t > bound``, else ``0``

Each is reported as its mean over the loss tokens (:func:`mismatch_means`).
"""

from __future__ import annotations

import torch

from core_rl.ops.kl import kl_estimate

#: the per-token mismatch values :func:`mismatch_values` returns, by name
MISMATCH_METRICS = ("abs_logprob_diff", "kl_behave_trainer", "ratio_out_of_bounds")


def mismatch_values(
    trainer_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, ratio_bound: float
) -> dict[str, torch.Tensor]:
    """The per-token values of :data:`MISMATCH_METRICS` (module docstring), float32, no gradient.
    ``ratio_bound`` > 1: the ratio ``r_t`` is in bounds on ``[1 / ratio_bound, ratio_bound]``."""
    trainer = trainer_logprobs.detach().float()
    behave = behave_logprobs.detach().float()
    d = trainer - behave
    log_bound = torch.log(torch.tensor(ratio_bound, dtype=torch.float32))
    return {
        "abs_logprob_diff": d.abs(),
        "kl_behave_trainer": kl_estimate(behave, trainer, "k3", cap=None),
        "ratio_out_of_bounds": (d.abs() > log_bound).float(),
    }


def mismatch_sums(
    trainer_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor, ratio_bound: float
) -> dict[str, float]:
    """``sum_t mask_t * v_t`` of each of :data:`MISMATCH_METRICS` and ``tokens = sum_t mask_t``:
    sums that add up over micro-batches and ranks before :func:`means_of_sums` divides them."""
    weights = mask.detach().float()
    values = mismatch_values(trainer_logprobs, behave_logprobs, ratio_bound)
    sums = {name: float(torch.where(weights != 0, value * weights, 0.0).sum()) for name, value in values.items()}
    sums["tokens"] = float(weights.sum())
    return sums


def means_of_sums(sums: dict[str, float]) -> dict[str, float]:
    """Each of :data:`MISMATCH_METRICS` as ``sum / tokens`` (empty when ``tokens`` is 0)."""
    tokens = sums.get("tokens", 0.0)
    if tokens <= 0:
        return {}
    return {name: sums[name] / tokens for name in MISMATCH_METRICS}


def mismatch_means(
    trainer_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor, ratio_bound: float
) -> dict[str, float]:
    """The mean of each of :data:`MISMATCH_METRICS` over the tokens of ``mask`` (a 0/1 loss mask):
    ``sum_t mask_t v_t / sum_t mask_t``; empty when the mask has no token."""
    return means_of_sums(mismatch_sums(trainer_logprobs, behave_logprobs, mask, ratio_bound))
