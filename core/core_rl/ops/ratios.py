"""Importance ratios between the policy being trained and the policy that produced (or anchors) the
samples, at token and sequence level, and per-sequence reductions over response tokens."""

from __future__ import annotations

import torch

from core_rl.ops.names import SEQUENCE_REDUCTIONS

#: log-ratios are clamped to this range before ``exp`` so a ratio stays finite (rho in [2e-9, 5e8])
MAX_LOG_RATIO = 20.0


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``log_ratio`` clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` (no gradient beyond)."""
    return log_ratio.clamp(min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO)


def policy_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Token importance ratio ``rho_t = exp(logprobs_t - old_logprobs_t) = pi(a_t|s_t) / pi_old(a_t|s_t)``,
    the log-ratio clamped to +-:data:`MAX_LOG_RATIO` first."""
    return torch.exp(clamp_log_ratio(logprobs - old_logprobs))


def sequence_reduce(values: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Per-row reduction ``[B]`` of ``values [B, T]`` over the tokens of ``mask``:

    - ``sum``:  sum_t m_t v_t
    - ``mean``: sum_t m_t v_t / max(sum_t m_t, 1)      (0 for a row with no tokens)
    - ``max``:  max_{t: m_t = 1} v_t                    (-inf for a row with no tokens)
    """
    m = mask.to(values.dtype)
    if how == "sum":
        return (values * m).sum(dim=-1)
    if how == "mean":
        return (values * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    if how == "max":
        return torch.where(mask != 0, values, torch.full_like(values, float("-inf"))).amax(dim=-1)
    raise ValueError(f"unknown sequence reduction {how!r}; expected one of {', '.join(SEQUENCE_REDUCTIONS)}")


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence log-ratio ``[B]``: ``log s_i = (1/|y_i|) sum_t (logprobs_{i,t} - old_{i,t})``,
    the log of the geometric mean of the token ratios (Zheng et al. 2025)."""
    return sequence_reduce(logprobs - old_logprobs, mask, "mean")


def gspo_token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token's per-token log-ratio ``[B, T]`` with the paper's stop-gradient form::

        s_{i,t}     = sg[s_i] * pi(y_t) / sg[pi(y_t)]
        log s_{i,t} = sg[log s_i] + logprobs_t - sg[logprobs_t]

    Its value is the sequence ratio ``s_i`` at every token (so clipping acts on whole sequences),
    and its gradient is ``s_i * grad log pi(y_t)``: averaged over a sequence's tokens
    (``seq-mean-token-mean``) it is exactly the gradient of the sequence-level GSPO objective.
    """
    seq = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)
    return logprobs - logprobs.detach() + seq[:, None]


def importance_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """The log of the ratio a clipped surrogate uses, ``[B, T]``: ``logprobs - old_logprobs`` at
    ``token`` level, :func:`gspo_token_log_ratio` at ``sequence`` level; clamped to
    +-:data:`MAX_LOG_RATIO`. With one-token responses both levels agree exactly."""
    if level == "token":
        return clamp_log_ratio(logprobs - old_logprobs)
    if level == "sequence":
        return clamp_log_ratio(gspo_token_log_ratio(logprobs, old_logprobs, mask))
    raise ValueError(f"unknown importance sampling level {level!r}; expected token or sequence")
