"""Loss-side controls against entropy collapse: the per-token covariance between log-prob and
advantage and the token selections of Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism
of Reinforcement Learning for Reasoning Language Models"), and the high-entropy token mask of the
"80/20" rule (Wang et al. 2025, "Beyond the 80/20 Rule").

Every function is per token over ``[B, T]`` tensors and reads its inputs without gradient (the
selections are masks); the losses that use them are :func:`clip_cov_loss` and :func:`kl_cov_loss`.
"""

from __future__ import annotations

import torch

from core_rl.ops.stats import masked_mean


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's contribution to the covariance of log-prob and advantage over the tokens of ``mask``::

        cov_t = (A_t - mean_mask(A)) * (log pi_t - mean_mask(log pi))      0 off the mask

    (the batch covariance is ``mean_mask(cov)``). No gradient flows through it.
    """
    lp, adv = logprobs.detach(), advantages.detach()
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
    return torch.where(mask != 0, cov, torch.zeros_like(cov))


def selection_count(ratio: float, n_tokens: int) -> int:
    """How many of ``n_tokens`` tokens a covariance selection takes: ``max(1, floor(ratio * n))``,
    at most ``n``, and 0 when ``ratio`` is 0 or there are no tokens (0 turns the selection off)."""
    if ratio <= 0 or n_tokens == 0:
        return 0
    return min(n_tokens, max(1, int(ratio * n_tokens)))


def clip_cov_select(
    cov: torch.Tensor,
    mask: torch.Tensor,
    *,
    ratio: float,
    low: float,
    high: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Bool ``[B, T]``: Clip-Cov's tokens. Among the tokens of ``mask`` whose covariance lies
    strictly inside ``(low, high)``, ``k = selection_count(ratio, |mask|)`` are drawn uniformly at
    random without replacement (all of them when fewer), with ``generator`` (a seeded generator
    makes the choice reproducible)."""
    on = mask != 0
    candidates = (on & (cov > low) & (cov < high)).flatten().nonzero().squeeze(1)
    k = min(selection_count(ratio, int(on.sum())), candidates.numel())
    order = torch.randperm(candidates.numel(), generator=generator, device=generator.device)
    chosen = candidates[order[:k].to(candidates.device)]
    selected = torch.zeros(on.numel(), dtype=torch.bool, device=on.device)
    selected[chosen] = True
    return selected.view_as(on)


def kl_cov_select(cov: torch.Tensor, mask: torch.Tensor, *, ratio: float) -> torch.Tensor:
    """Bool ``[B, T]``: KL-Cov's tokens, the ``k = selection_count(ratio, |mask|)`` tokens of
    ``mask`` with the largest covariance (ties broken by position, first wins)."""
    on = mask != 0
    values = cov[on]
    k = selection_count(ratio, values.numel())
    top = torch.sort(values, descending=True, stable=True).indices[:k]
    picked = torch.zeros(values.numel(), dtype=torch.bool, device=cov.device)
    picked[top] = True
    selected = torch.zeros_like(on)
    selected[on] = picked
    return selected


def clip_cov_loss(
    loss: torch.Tensor, clipped: torch.Tensor, selected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip-Cov on a clipped surrogate ``l`` (:func:`core_rl.ops.ppo_clip_loss`): the selected tokens
    that the trust-region clip has not already clipped leave the loss, value and gradient::

        c_t = [t selected] and not [t clipped]
        l_t = 0 if c_t else l_t

    Returns ``(l, c)``."""
    corrected = selected & ~clipped
    return torch.where(corrected, torch.zeros_like(loss), loss), corrected


def kl_cov_loss(
    ratio: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, selected: torch.Tensor, coef: float
) -> torch.Tensor:
    """KL-Cov's surrogate: the *unclipped* policy gradient, plus a penalty on the absolute log-ratio
    of the selected tokens::

        l_t = -A_t * rho_t + coef * |log rho_t| * [t selected]

    with ``rho_t = exp(log_ratio_t)``; ``|log rho|`` is differentiated (gradient ``coef *
    sign(log rho_t)`` with respect to ``log pi_t``; 0 at ``rho_t = 1``)."""
    base = -advantages * ratio
    return torch.where(selected, base + coef * log_ratio.abs(), base)


def top_quantile_mask(values: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Bool ``[B, T]``: the tokens of ``mask`` whose value is in the top ``quantile`` fraction::

        tau    = Q_{1 - quantile}({v_t : t in mask})      the linearly interpolated quantile
        keep_t = [t in mask] and v_t >= tau

    (``Q_p`` of sorted values ``s_0 <= ... <= s_{n-1}``: ``s_j + f (s_{j+1} - s_j)`` with
    ``j + f = p (n - 1)``, as :func:`torch.quantile`). About ``quantile * n`` tokens are kept (ties
    at the threshold are all kept); ``quantile = 1`` keeps every token of the mask.
    """
    on = mask != 0
    sorted_values = torch.sort(values.detach()[on].float()).values
    n = sorted_values.numel()
    if n == 0:
        return on
    position = (1.0 - quantile) * (n - 1)
    j = min(int(position), n - 1)
    upper = min(j + 1, n - 1)
    tau = torch.lerp(sorted_values[j], sorted_values[upper], position - j)
    return on & (values.detach().float() >= tau)


def adaptive_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, low: float, high: float
) -> float:
    """Skywork-OR1's adaptive entropy coefficient after a step whose policy entropy was ``entropy``::

        coef' = min(coef + delta, high)    if entropy <= target
        coef' = max(coef - delta, low)     otherwise

    The bonus ``coef' * H`` then applies at the next step only while ``entropy <= target``."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)
