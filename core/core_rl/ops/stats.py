"""Masked and grouped statistics: sums and means over response tokens, per-group mean and standard
deviation, and the one normalisation (batch or group level, optional leave-one-out baseline) that
rewards, advantages and REINFORCE++'s whitening share.

Values are ``[B]`` (one per sample) or ``[B, T]`` (one per token, with a ``mask`` of the tokens that
count). Groups are given by a ``[B]`` label per sample (the prompt the sample answers).
"""

from __future__ import annotations

import torch

from core_rl.ops.names import NORM_LEVELS


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t values_t * mask_t."""
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1): the mean over masked positions (0 for an empty mask)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def group_ids_to_dense(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels to 0..G-1; return (dense labels, G)."""
    uniques, dense = torch.unique(group_index, return_inverse=True)
    return dense, int(uniques.numel())


def segment_sum(values: torch.Tensor, dense: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-group sums ``[G]`` of per-sample ``values [B]`` under dense labels ``[B]`` in ``0..G-1``."""
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add(0, dense, values)


def group_mean_std(
    values: torch.Tensor, group_index: torch.Tensor, *, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, group standard deviation and group size, three ``[B]`` tensors.

    ``std_g = sqrt( sum_{j in g} (v_j - mean_g)^2 / (n_g - 1) )`` (``unbiased``, as ``torch.std``;
    0 for a group of one) or ``/ n_g``.
    """
    dense, n_groups = group_ids_to_dense(group_index)
    values = values.float()
    counts = segment_sum(torch.ones_like(values), dense, n_groups)
    means = segment_sum(values, dense, n_groups) / counts
    sq = segment_sum((values - means[dense]).square(), dense, n_groups)
    denom = (counts - 1.0).clamp(min=1.0) if unbiased else counts
    std = (sq / denom).sqrt()
    if unbiased:
        std = torch.where(counts > 1, std, torch.zeros_like(std))
    return means[dense], std[dense], counts[dense]


def _rows_and_mask(values: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` and ``mask`` as float ``[B, T]`` (a ``[B]`` tensor is one element per row)."""
    v = values.float()
    if v.ndim == 1:
        v = v[:, None]
        m = torch.ones_like(v) if mask is None else mask.float().reshape(v.shape)
    else:
        m = torch.ones_like(v) if mask is None else mask.float()
    return v, m


def group_is_uniform(values: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[B]``: True where every (masked) value of the sample's group is exactly the same,
    ``max_{j in g} v_j == min_{j in g} v_j`` (always true for a group of one).

    Exact comparison, unlike ``std == 0``, which rounding in the mean can break (e.g. three 0.1s).
    """
    v, m = _rows_and_mask(values, mask)
    dense, n_groups = group_ids_to_dense(group_index.to(v.device))
    on = m != 0
    row_max = torch.where(on, v, float("-inf")).amax(dim=1)
    row_min = torch.where(on, v, float("inf")).amin(dim=1)
    gmax = torch.full((n_groups,), float("-inf"), device=v.device).scatter_reduce(0, dense, row_max, "amax")
    gmin = torch.full((n_groups,), float("inf"), device=v.device).scatter_reduce(0, dense, row_min, "amin")
    return (gmax == gmin)[dense]


def _labels(level: str, group_index: torch.Tensor | None, n_rows: int, device: torch.device) -> torch.Tensor:
    if level == "group":
        if group_index is None:
            raise ValueError("group-level normalisation needs group_index")
        return group_index.to(device)
    return torch.zeros(n_rows, dtype=torch.long, device=device)


def normalize(
    values: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    mean_level: str = "batch",
    std_level: str = "batch",
    leave_one_out: bool = False,
    unbiased: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Centre and scale ``values`` over a batch or within groups; the result is 0 off ``mask``.

    Every masked element counts once (for ``[B, T]`` values a sample weighs as many tokens as it has).
    Within a set ``S`` (the whole batch, or the samples of one group) with ``N_S`` masked elements::

        mean_S = (1/N_S) sum_{e in S} v_e
        b_e    = mean_S                                                  (leave_one_out: false)
        b_e    = (sum_{e' in S} v_e' - sum_{e' in row(e)} v_e') / (N_S - N_row(e))
                 the mean over the *other* samples of S                  (leave_one_out: true)
        std_S  = sqrt( sum_{e in S} (v_e - mean_S)^2 / (N_S - 1) )      (unbiased; 0 if N_S = 1)
        std_S  = sqrt( sum_{e in S} (v_e - mean_S)^2 / N_S )            (unbiased: false)
        out_e  = (v_e - b_e) / (std_S' + eps)

    ``mean_level`` picks the sets of the baseline and ``std_level`` those of ``std`` (``batch``,
    ``group`` or ``none``: no centring / no scaling). Where the baseline's set holds one value only
    (every masked value exactly equal, e.g. equal rewards in a group), ``v_e - b_e`` is exactly 0:
    such a set carries no relative signal, and rounding in ``mean_S`` must not leak ``ulp / eps``.
    A set of one sample with ``leave_one_out`` has no other sample; its baseline is its own mean.
    """
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in NORM_LEVELS:
            raise ValueError(f"{name} must be one of {', '.join(NORM_LEVELS)}, got {level!r}")
    v, m = _rows_and_mask(values, mask)
    n_rows = v.shape[0]
    row_sum = (v * m).sum(dim=1)
    row_count = m.sum(dim=1)
    out = v
    if mean_level != "none":
        labels = _labels(mean_level, group_index, n_rows, v.device)
        dense, n_groups = group_ids_to_dense(labels)
        g_sum = segment_sum(row_sum, dense, n_groups)[dense]
        g_count = segment_sum(row_count, dense, n_groups)[dense]
        baseline = g_sum / g_count.clamp(min=1.0)
        if leave_one_out:
            others = g_count - row_count
            loo = (g_sum - row_sum) / others.clamp(min=1.0)
            baseline = torch.where(others > 0, loo, baseline)
        out = v - baseline[:, None]
        uniform = group_is_uniform(v, labels, m)
        out = torch.where(uniform[:, None], torch.zeros_like(out), out)
    if std_level != "none":
        labels = _labels(std_level, group_index, n_rows, v.device)
        dense, n_groups = group_ids_to_dense(labels)
        g_count = segment_sum(row_count, dense, n_groups)
        g_mean = segment_sum(row_sum, dense, n_groups) / g_count.clamp(min=1.0)
        sq = ((v - g_mean[dense][:, None]).square() * m).sum(dim=1)
        g_sq = segment_sum(sq, dense, n_groups)
        denom = (g_count - 1.0) if unbiased else g_count
        std = torch.where(denom > 0, g_sq / denom.clamp(min=1.0), torch.zeros_like(g_sq)).sqrt()
        out = out / (std[dense][:, None] + eps)
    out = out * m
    return out.reshape(values.shape) if values.ndim == 1 else out


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-5) -> torch.Tensor:
    """Batch-level whitening over masked elements: ``(v - mean) / (std + eps)`` with the unbiased
    standard deviation over every masked element of the batch (0 off the mask)."""
    return normalize(values, mask=mask, mean_level="batch", std_level="batch", eps=eps)
