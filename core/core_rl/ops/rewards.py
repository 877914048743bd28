"""Reward shaping on scalar rewards ``[B]`` and outcome rewards spread over response tokens."""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_new_tokens: int, overlong_tokens: int, factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment ``[B]`` (Yu et al. 2025), with ``L_max = max_new_tokens`` and
    ``L_cache = overlong_tokens``::

        p(L) = 0                                    L <= L_max - L_cache
        p(L) = ((L_max - L_cache) - L) / L_cache    L_max - L_cache < L <= L_max
        p(L) = -1                                   L > L_max

    times ``factor``; it is added to the reward of a response of ``L`` tokens.
    """
    expected = max_new_tokens - overlong_tokens
    excess = response_lengths.float() - expected
    return factor * (-excess / overlong_tokens).clamp(min=-1.0, max=0.0)


def scale_rewards(rewards: torch.Tensor, *, scale: float, bias: float, clip: float | None) -> torch.Tensor:
    """``clip((r + bias) * scale, -clip, clip)`` (no clipping when ``clip`` is None)."""
    out = (rewards.float() + bias) * scale
    return out if clip is None else out.clamp(min=-clip, max=clip)


def discounted_outcome_returns(scores: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns ``[B, T]`` of an outcome reward paid at a response's last token::

        G_{i,t} = gamma^{k_{i,t}} * scores_i,   k_{i,t} = number of response tokens of row i after t

    (``G = scores_i`` on every response token when ``gamma = 1``; 0 off the mask).
    """
    m = mask.float()
    after = m.flip(-1).cumsum(-1).flip(-1) - m
    return scores.float()[:, None] * torch.pow(torch.full_like(m, float(gamma)), after) * m
