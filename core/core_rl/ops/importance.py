"""Importance weights against the behaviour policy and their rejection / truncation (the
``algorithm.rejection_sampling`` section: level token|sequence, action mask|clamp, a divergence
metric, sequence aggregation sum|mean|max, bounds lower/upper).

With ``log r_t = log pi_prox(y_t) - log pi_behave(y_t)`` (``pi_prox``: the proximal policy of the
decoupled loss, ``pi_behave``: the policy that generated the token), the built-in metrics are:

- ``ratio``:  ``r_t`` (compared and aggregated in log space)
- ``kl_k1``:  ``log r_t``
- ``kl_k2``:  ``(log r_t)^2 / 2``
- ``kl_k3``:  ``r_t - log r_t - 1``
"""

from __future__ import annotations

import math

import torch

from core_rl.ops.kl import kl_estimate
from core_rl.ops.names import REJECTION_ACTIONS, REJECTION_LEVELS
from core_rl.ops.ratios import clamp_log_ratio, sequence_reduce


def behaviour_log_ratio(proximal_logprobs: torch.Tensor, behave_logprobs: torch.Tensor) -> torch.Tensor:
    """``log r_t = log pi_prox - log pi_behave``, clamped like every log-ratio (no gradient)."""
    return clamp_log_ratio((proximal_logprobs - behave_logprobs).detach())


def divergence_metric(proximal_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, metric: str) -> torch.Tensor:
    """A built-in per-token metric (see the module docstring); ``ratio`` is returned as ``log r``."""
    if metric in ("ratio", "kl_k1"):
        return behaviour_log_ratio(proximal_logprobs, behave_logprobs)
    if metric == "kl_k2":
        return kl_estimate(proximal_logprobs.detach(), behave_logprobs, "k2", cap=None)
    if metric == "kl_k3":
        return kl_estimate(behave_logprobs, proximal_logprobs.detach(), "k3", cap=None)
    raise ValueError(f"unknown divergence metric {metric!r}")


def reject_by_metric(
    values: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    action: str,
    agg: str,
    upper: float,
    lower: float | None,
    log_space: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Importance weights, keep-mask and clamp-mask, all ``[B, T]``, from per-token metric ``values``.

    ``log_space``: ``values`` are logs of ratios (the ``ratio`` metric); bounds apply to ``exp``.

    1. The judged value: at ``token`` level ``x_t = values_t``; at ``sequence`` level one value per
       sequence, over its tokens: ``sum``, ``mean`` or ``max`` of ``values`` (in log space for
       ratios: ``exp(sum log r)`` = the product, ``exp(mean log r)`` = the geometric mean).
    2. The weight: at token level ``w_t = r_t``; at sequence level with a ratio metric the
       sequence's aggregated ratio, with another metric ``r_t``.
    3. ``action: mask``: ``keep = lower <= x <= upper`` (no lower bound when ``lower`` is None),
       weights unchanged. ``action: clamp`` (ratio metrics): every token kept,
       ``w = clamp(w, lower or 0, upper)``: truncated importance sampling.

    The third tensor is True where ``clamp`` changed a weight. Off ``mask``: weight 0, keep and
    clamped False. Nothing here carries a gradient.
    """
    on = mask != 0
    values = values.detach().float()
    if level == "token":
        x = values.exp() if log_space else values
        weight = log_ratio.exp()
    elif level == "sequence":
        seq = sequence_reduce(values, mask, agg)
        x = (seq.exp() if log_space else seq)[:, None].expand_as(values)
        weight = x if log_space else log_ratio.exp()
    else:
        raise ValueError(f"unknown rejection level {level!r}; expected one of {', '.join(REJECTION_LEVELS)}")
    low = -math.inf if lower is None else lower
    if action == "mask":
        keep = on & (x >= low) & (x <= upper)
        clamped = torch.zeros_like(on)
    elif action == "clamp":
        if not log_space:
            raise ValueError("action 'clamp' truncates an importance ratio: it needs a ratio metric")
        keep = on
        truncated = weight.clamp(min=max(low, 0.0), max=upper)
        clamped = on & (truncated != weight)
        weight = truncated
    else:
        raise ValueError(f"unknown rejection action {action!r}; expected one of {', '.join(REJECTION_ACTIONS)}")
    return torch.where(on, weight, torch.zeros_like(weight)), keep, clamped
