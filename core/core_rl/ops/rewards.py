"""Reward shaping on scalar rewards ``[B]`` and outcome rewards spread over response tokens."""

from __future__ import annotations

import torch

from core_rl.ops.stats import normalize


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


def normalize_then_sum(
    parts: torch.Tensor,
    weights: torch.Tensor,
    group_index: torch.Tensor,
    *,
    unbiased: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """GDPO's aggregation of a reward's parts ``[B, K]`` (Liu et al. 2026, "Group reward-Decoupled
    Normalization Policy Optimization"; TRL's ``multi_objective_aggregation: normalize_then_sum``):
    each part is normalised within each group first, then the parts are summed with ``weights``
    ``[K]``. For sample ``i`` of group ``g`` and part ``k``, over the members ``j`` of ``g`` where part
    ``k`` is present (a NaN or infinite ``parts[j, k]`` is absent: the part does not apply)::

        z_ik = (p_ik - mean_g(p_k)) / (std_g(p_k) + eps)      (0 where p_ik is absent)
        r_i  = sum_k weights_k * z_ik

    ``std_g`` is unbiased (Bessel's correction) unless ``unbiased`` is false, 0 for one present
    member; a part whose present values are all equal in a group gives exactly 0 there
    (:func:`core_rl.ops.normalize` at group level, masked to the present values). A sample with no
    part present gets 0.
    """
    values = parts.float()
    present = torch.isfinite(values)
    filled = torch.where(present, values, torch.zeros_like(values))
    total = torch.zeros(values.shape[0], dtype=torch.float32, device=values.device)
    for k in range(values.shape[1]):
        z = normalize(
            filled[:, k],
            mask=present[:, k],
            group_index=group_index,
            mean_level="group",
            std_level="group",
            unbiased=unbiased,
            eps=eps,
        )
        total = total + float(weights[k]) * z
    return total


def discounted_outcome_returns(scores: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns ``[B, T]`` of an outcome reward paid at a response's last token::

        G_{i,t} = gamma^{k_{i,t}} * scores_i,   k_{i,t} = number of response tokens of row i after t

    (``G = scores_i`` on every response token when ``gamma = 1``; 0 off the mask).
    """
    m = mask.float()
    after = m.flip(-1).cumsum(-1).flip(-1) - m
    return scores.float()[:, None] * torch.pow(torch.full_like(m, float(gamma)), after) * m
