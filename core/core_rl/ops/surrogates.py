"""Per-token policy-gradient surrogates and the masks of the off-policy corrections: PPO's clipped
objective (clip-higher, dual clip), SAPO's soft gate, CISPO's clipped weight, GMPO's geometric mean, off-policy
sequence masking, M2PO, and the log-linear proximal policy of the decoupled loss.

Every loss here is *to minimise* and per token; aggregation is :mod:`core_rl.ops.aggregation`'s.
"""

from __future__ import annotations

import torch

from core_rl.ops.ratios import sequence_reduce


def ppo_clip_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    c_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss and where each clip is active.

    With ``rho`` the ratio and ``A`` the advantage::

        l_unclipped = -A * rho
        l_clipped   = -A * clip(rho, 1 - eps_low, 1 + eps_high)
        l           = max(l_unclipped, l_clipped)                     # PPO (Schulman et al. 2017)
        l           = min(l, -c * A)          where A < 0, if c_clip = c > 1     (Ye et al. 2020)

    ``eps_high > eps_low`` is DAPO's clip-higher. Returns ``(l, clipped, dual_clipped)``:
    ``clipped`` is True where the trust-region clip is the active branch (``l_clipped >
    l_unclipped``: the ratio left the range in the direction the advantage favours, so the gradient
    is 0); ``dual_clipped`` where the dual clip bounds the loss (``A < 0`` and ``rho > c``; gradient 0).
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(min=1.0 - eps_low, max=1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if c_clip is None:
        return loss, clipped, torch.zeros_like(clipped)
    bound = -c_clip * advantages
    dual_clipped = (advantages < 0) & (loss > bound)
    return torch.where(dual_clipped, bound, loss), clipped, dual_clipped


def sapo_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, *, tau_pos: float, tau_neg: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO's soft-gated surrogate (Gao et al. 2025), replacing the hard clip::

        tau_t = tau_pos if A_t > 0 else tau_neg
        f(r)  = (4 / tau) * sigmoid(tau * (r - 1))
        l_t   = -A_t * f(rho_t)

    ``f'(1) = 1``, so on-policy the gradient equals PPO's; away from ``rho = 1`` it decays smoothly
    (faster for larger ``tau``). Returns ``(l, gate)`` with ``gate = f'(rho) = 4 s (1 - s)``,
    ``s = sigmoid(tau (rho - 1))``: the factor the gradient of ``-A rho`` is multiplied by (1 on-policy).
    """
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    s = torch.sigmoid(tau * (ratio - 1.0))
    loss = -advantages * (4.0 / tau) * s
    return loss, (4.0 * s * (1.0 - s)).detach()


def cispo_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, *, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's surrogate (MiniMax-M1, Chen et al. 2025): the importance weight is clipped and
    detached, and every token keeps its gradient::

        w_t = clip(rho_t, 1 - eps_low, 1 + eps_high)
        l_t = -A_t * sg(w_t / rho_t) * rho_t          value -A_t w_t;  gradient -A_t w_t grad log pi(y_t)

    (``grad rho = rho grad log pi``), the REINFORCE gradient weighted by the clipped ratio, where
    PPO's clip zeroes the gradient of a token whose ratio left the range. ``eps_low = 1`` sets no
    lower bound. At sequence level (``rho`` the GSPO ratio, whose gradient is ``s_i grad log pi``)
    the sequence's clipped weight scales each of its tokens. Returns ``(l, truncated)``, where
    ``truncated`` marks the tokens whose weight the clip changed.
    """
    weight = ratio.detach().clamp(min=1.0 - eps_low, max=1.0 + eps_high)
    loss = -advantages * (weight / ratio.detach()) * ratio
    return loss, weight != ratio.detach()


def gmpo_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GMPO's surrogate (Geometric-Mean Policy Optimization, Zhao et al. 2025; verl's
    ``loss_mode: geo_mean``): the geometric mean of a sequence's token ratios, each clipped in log
    space on the pessimistic side, in place of the arithmetic mean of token objectives.

    For sequence ``i`` with loss tokens ``t`` (``mask``) and ``x_t = log rho_t`` (``log_ratio``)::

        A_i       = mean_t A_{i,t}                       (every token's A for outcome estimators)
        s_i       = sign(A_i)
        c_t       = clip(x_t, -eps_low, eps_high)
        x'_t      = s_i * min(s_i * x_t, s_i * c_t)      (the pessimistic side, as PPO's clip)
        log g_i   = mean_t x'_t                          (g_i: the clipped geometric-mean ratio)
        L_i       = -A_i * exp(log g_i)

    Returns ``(l, clipped)``, both ``[B, T]``: ``l_{i,t} = L_i`` on every position of row ``i``
    (the caller masks it), so aggregating with ``seq-mean-token-mean`` weights (``1 / (N |y_i|)``)
    gives ``mean_i L_i``, the paper's objective (and verl's); ``clipped`` is True on the loss tokens
    whose clipped log-ratio is the branch taken (``s_i c_t < s_i x_t``: the ratio left the range in
    the direction the advantage favours; their gradient is 0). The gradient with respect to ``x_t``
    of an unclipped token is ``-A_i g_i / |y_i|``.
    """
    on = mask != 0
    adv = sequence_reduce(advantages, mask, "mean")
    sign = torch.sign(adv)[:, None]
    bounded = log_ratio.clamp(min=-eps_low, max=eps_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    geo = torch.exp(sequence_reduce(pessimistic, mask, "mean"))
    loss = (-adv * geo)[:, None].expand_as(log_ratio)
    clipped = on & (sign * bounded < sign * log_ratio)
    return loss, clipped


def off_policy_sequence_mask(
    logprobs: torch.Tensor,
    behave_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Bool ``[B, T]`` keep-mask of off-policy sequence masking (DeepSeek-V3.2): drop sequence ``i``
    when its advantage is negative and the policy has drifted far from the behaviour policy on it::

        drop_i = mean_t(A_{i,t}) < 0  and  (1/|y_i|) sum_t (behave_logprobs_{i,t} - logprobs_{i,t}) > threshold

    (the mean over the sequence's tokens of ``log pi_behave / pi``, a k1 estimate of
    KL(pi_behave || pi) on it). ``logprobs`` is read without gradient.
    """
    drift = sequence_reduce(behave_logprobs - logprobs.detach(), mask, "mean")
    negative = sequence_reduce(advantages, mask, "mean") < 0
    keep = ~(negative & (drift > threshold))
    return keep[:, None].expand_as(mask) & (mask != 0)


def m2po_mask(
    behave_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Bool ``[B, T]`` keep-mask of M2PO (second-moment trust region, Zheng et al. 2025).

    With ``m2_t = (behave_logprobs_t - proximal_logprobs_t)^2`` on the tokens of ``mask``: the tokens
    of largest ``m2`` are dropped, largest first, until the mean ``m2`` of those left is below
    ``threshold`` (at least one token is always kept). Computed over the whole batch it is given,
    so the trainer calls it once on the global batch (ties are broken by position).
    """
    on = mask != 0
    m2 = (behave_logprobs - proximal_logprobs).float().square()[on]
    n = m2.numel()
    keep = torch.zeros_like(on)
    if n == 0:
        return keep
    order = torch.sort(m2, descending=True, stable=True).indices
    ranked = m2[order]
    suffix_mean = ranked.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, device=m2.device, dtype=m2.dtype)
    below = suffix_mean < threshold
    n_drop = int(torch.argmax(below.int()).item()) if bool(below.any()) else n - 1
    kept_ranked = torch.arange(n, device=m2.device) >= n_drop
    kept = torch.empty_like(kept_ranked)
    kept[order] = kept_ranked
    keep[on] = kept
    return keep


def loglinear_proximal_logprobs(
    behave_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    versions: torch.Tensor,
    train_version: torch.Tensor,
) -> torch.Tensor:
    """Approximate proximal log-probs ``[B, T]`` of the decoupled loss without a forward pass
    (AReaL's ``loglinear``): interpolate in log space between the behaviour policy and the current one::

        v_theta = train_version            (the version this update produces)
        v_prox  = v_theta - 1              (the weights the update started from)
        alpha   = clamp((v_prox - v_b) / (v_theta - v_b), 0, 1)      (0 where v_theta <= v_b)
        log pi_prox ~= log pi_behave + alpha * (log pi_theta - log pi_behave)

    with ``v_b`` the version that generated each token (``versions``, -1 off the response: alpha 0
    there). A token generated by the weights the update starts from (synchronous training) gets
    alpha 0: the proximal policy is then the behaviour policy. ``train_version`` is ``[B]``;
    ``logprobs`` is read without gradient.
    """
    v_b = versions.to(behave_logprobs.dtype)
    v_theta = train_version.to(behave_logprobs.dtype)[:, None]
    span = v_theta - v_b
    alpha = torch.where((span > 0) & (versions >= 0), (span - 1.0) / span.clamp(min=1.0), torch.zeros_like(v_b))
    alpha = alpha.clamp(0.0, 1.0)
    return behave_logprobs + alpha * (logprobs.detach() - behave_logprobs)
