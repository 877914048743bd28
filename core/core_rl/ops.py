"""Small pure tensor functions shared by algorithms: masked statistics, loss aggregation, KL estimators.

All ``[B, T]`` arguments follow :mod:`core_rl.protocol`'s convention; ``mask`` is the response mask.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t values_t * mask_t."""
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1): the mean over masked positions (0 for an empty mask)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregation_weights(mask: torch.Tensor, mode: str, *, norm_length: float | None = None) -> torch.Tensor:
    """Per-token weights ``w`` such that the aggregated loss is ``sum_{i,t} w_{i,t} * l_{i,t}``.

    Computed once on the *global* batch, so summing ``w * l`` over any split into micro-batches or
    data-parallel ranks gives the same loss. With ``N`` sequences, ``L_i = sum_t mask_{i,t}``:

    - ``token-mean``:               w = mask / sum_{i,t} mask
    - ``seq-mean-token-mean``:      w = mask / (N * L_i)
    - ``seq-mean-token-sum``:       w = mask / N
    - ``seq-mean-token-sum-norm``:  w = mask / (N * C), C = ``norm_length`` (default: the width T)

    Sequences with no response tokens get weight 0.
    """
    mask = mask.float()
    n_seq = mask.shape[0]
    if mode == "token-mean":
        return mask / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        return mask / (lengths * n_seq)
    if mode == "seq-mean-token-sum":
        return mask / n_seq
    if mode == "seq-mean-token-sum-norm":
        c = float(norm_length if norm_length is not None else mask.shape[-1])
        return mask / (n_seq * c)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, with ``d = logprobs - ref_logprobs``:

    - ``k1``: d                      (unbiased, high variance, can be negative)
    - ``k2``: d^2 / 2                (biased, low variance)
    - ``k3``: exp(-d) - 1 + d        (unbiased, non-negative)
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        # clamp keeps exp finite when the policies have drifted far apart
        return torch.exp(-d.clamp(min=-20.0, max=20.0)) - 1.0 + d
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def group_ids_to_dense(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels to 0..G-1; return (dense labels, G)."""
    uniques, dense = torch.unique(group_index, return_inverse=True)
    return dense, int(uniques.numel())


def group_mean_std(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, group standard deviation (unbiased, 0 for a group of one) and group size.

    ``values``: [B]; ``group_index``: [B]. Returns three [B] tensors.
    """
    dense, n_groups = group_ids_to_dense(group_index)
    values = values.float()
    zeros = torch.zeros(n_groups, device=values.device, dtype=values.dtype)
    counts = zeros.index_add(0, dense, torch.ones_like(values))
    sums = zeros.index_add(0, dense, values)
    means = sums / counts
    sq = zeros.index_add(0, dense, (values - means[dense]).square())
    std = torch.where(counts > 1, (sq / (counts - 1).clamp(min=1.0)).sqrt(), torch.zeros_like(sq))
    return means[dense], std[dense], counts[dense]
