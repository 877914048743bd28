"""The math of a learned value function (PPO's critic): per-token rewards of a sequence, generalised
advantage estimation, and the clipped value loss.

All ``[B, T]`` tensors follow :mod:`core_rl.protocol` (position ``t`` describes token ``t``). A
value ``V_t`` estimates the return from the state in which token ``t`` is about to be generated.
"""

from __future__ import annotations

import torch

from core_rl.ops.names import VALUE_LOSSES


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float: 1 at the last position of each row where ``mask`` is non-zero (rows
    without any: all 0)."""
    m = (mask != 0).float()
    position = torch.arange(m.shape[1], device=m.device, dtype=torch.float32)
    last = (m * (position + 1)).argmax(dim=1)
    out = torch.zeros_like(m)
    out[torch.arange(m.shape[0]), last] = 1.0
    return out * m


def token_level_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]`` of outcome ``scores [B]`` paid at each response's last token,
    with a KL penalty folded in on every response token (Ziegler et al. 2019)::

        r_t = -kl_coef * kl_t * mask_t  +  scores * [t is the last token of the mask]

    ``kl`` ``[B, T]``: a per-token KL estimate to the reference (:func:`core_rl.ops.kl_estimate`).

    ``turn_rewards`` ``[B, T]`` (a multi-turn batch's, :mod:`core_rl.protocol`): each turn's reward
    at that turn's last token. They are paid where they stand, and only what the score holds beyond
    their sum is paid at the last token, so a row's rewards still add up to its score::

        r_t = turn_rewards_t + (scores - sum_t' turn_rewards_t') * [t is the last token of the mask]

    (the remainder is 0 when the score is the sum of the turn rewards; it is what reward shaping
    or a second reward added).
    """
    m = mask.float()
    outcome = scores.float()
    if turn_rewards is not None:
        outcome = outcome - turn_rewards.float().sum(dim=1)
    rewards = outcome[:, None] * last_token_mask(m)
    if turn_rewards is not None:
        rewards = rewards + turn_rewards.float()
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.float() * m
    return rewards


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, discount: float, gae_lambda: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the masked tokens of each row;
    returns ``(advantages, returns)``, both ``[B, T]`` and 0 off the mask.

    With ``t'`` the next masked position after ``t`` (``V_{t'} = 0`` after the last one: the episode
    ends)::

        delta_t = r_t + discount * V_{t'} - V_t
        A_t     = delta_t + discount * gae_lambda * A_{t'}
        R_t     = A_t + V_t                 (the value target)

    so ``gae_lambda = 1`` gives ``A_t = sum_k discount^k r_{t+k} - V_t`` (Monte-Carlo returns minus
    the value) and ``gae_lambda = 0`` gives ``A_t = delta_t`` (one-step TD). Unmasked positions
    (padding, prompt) are skipped: they pass the next value and advantage through unchanged.
    Computed backwards over ``T``, vectorised over rows.
    """
    m = mask.float()
    r, v = rewards.float() * m, values.float() * m
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    advantages = torch.zeros_like(v)
    for t in range(v.shape[1] - 1, -1, -1):
        on = m[:, t]
        delta = r[:, t] + discount * next_value - v[:, t]
        adv = delta + discount * gae_lambda * next_adv
        advantages[:, t] = adv * on
        next_adv = torch.where(on != 0, adv, next_adv)
        next_value = torch.where(on != 0, v[:, t], next_value)
    return advantages, (advantages + v) * m


def huber(error: torch.Tensor, delta: float) -> torch.Tensor:
    """``0.5 * e^2`` where ``|e| <= delta``, else ``delta * (|e| - 0.5 * delta)`` (elementwise)."""
    abs_error = error.abs()
    return torch.where(abs_error <= delta, 0.5 * error.square(), delta * (abs_error - 0.5 * delta))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    eps_clip: float | None,
    loss: str = "mse",
    huber_delta: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and where the clipped branch is the larger one.

    With ``L(v) = 0.5 * (v - R)^2`` (``mse``) or ``huber(v - R, huber_delta)`` (``huber``)::

        v_clip = V_old + clip(v - V_old, -eps_clip, eps_clip)
        l      = max(L(v), L(v_clip))          (eps_clip None: l = L(v))

    Returns ``(l, clipped)`` with ``clipped = L(v_clip) > L(v)`` (the gradient is 0 there).
    """

    def per_token(v: torch.Tensor) -> torch.Tensor:
        error = v - returns
        if loss == "mse":
            return 0.5 * error.square()
        if loss == "huber":
            return huber(error, huber_delta)
        raise ValueError(f"unknown value loss {loss!r}; expected one of {', '.join(VALUE_LOSSES)}")

    unclipped = per_token(values)
    if eps_clip is None:
        return unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (values - old_values).clamp(min=-eps_clip, max=eps_clip)
    clipped_loss = per_token(clipped_values)
    return torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped
