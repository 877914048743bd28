"""Per-token estimators of the KL divergence between two policies from samples of the first."""

from __future__ import annotations

import math

import torch

from core_rl.ops.names import KL_ESTIMATORS

#: default bound on an estimate's magnitude: beyond it the estimate is held at the bound and its
#: gradient is 0 (as verl and AReaL do), so a few tokens far off the reference cannot dominate a step
KL_CAP = 10.0


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str, *, cap: float | None = KL_CAP
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, with ``d = logprobs - ref_logprobs``
    (Schulman 2020):

    - ``k1``: d                      (unbiased, high variance, can be negative)
    - ``k2``: d^2 / 2                (biased, low variance)
    - ``k3``: exp(-d) - 1 + d        (unbiased, non-negative)

    then clamped to ``[-cap, cap]`` (``cap=None``: not clamped). ``clamp`` passes no gradient where
    it is active, so a capped token's gradient is exactly 0. ``k3`` is evaluated exactly wherever it
    is below the cap: ``d`` is first raised to ``-(log(1 + cap) + 1)``, a point where ``k3`` already
    exceeds ``cap``, so ``exp`` stays finite and the value and gradient below the cap are exact.
    Without a cap ``k3`` is exact (``+inf`` once ``exp(-d)`` overflows).
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d.square()
    elif estimator == "k3":
        if cap is not None:
            d = d.clamp(min=-(math.log1p(cap) + 1.0))
        kl = torch.expm1(-d) + d
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    return kl if cap is None else kl.clamp(min=-cap, max=cap)


def adaptive_kl_coef(coef: float, observed_kl: float, *, target: float, horizon: int, n_steps: int) -> float:
    """One update of the adaptive KL controller (Ziegler et al. 2019): with
    ``e = clip(observed_kl / target - 1, -0.2, 0.2)``, the new coefficient is
    ``coef * (1 + e * n_steps / horizon)``. ``n_steps``: samples (or steps) since the last update."""
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


def reverse_kl_distill_loss(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, baseline: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """Per-token loss of on-policy distillation: the reverse KL(pi || pi_teacher) on the policy's own
    samples, minimised by a policy gradient whose per-token reward is ``-(log pi - log pi_teacher)``::

        l_t = sg(log pi_t - log pi_teacher_t - b) * log pi_t

    Its gradient is ``(d_t - b) * grad log pi_t`` (``d`` = the k1 estimate of the KL at token
    ``t``), whose expectation over samples of ``pi`` is the gradient of the per-token reverse KL for
    any constant ``b`` (``E[grad log pi] = 0``; the k1 estimate itself has a gradient of zero mean).
    A baseline ``b`` (e.g. the batch's mean ``d``, broadcast against ``[B, T]``) lowers the variance."""
    return (logprobs - teacher_logprobs - baseline).detach() * logprobs


def topk_forward_kl_loss(teacher_topk_logprobs: torch.Tensor, student_topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-position forward KL(pi_teacher || pi) over the teacher's top-k tokens, from the teacher's
    log-probs of its ``k`` most likely tokens and the policy's log-probs of the same tokens (both
    ``[..., k]``, the policy's a log-softmax over the full vocabulary gathered at the teacher's ids)::

        q_v = softmax(teacher_topk_logprobs)_v          (the teacher renormalised over its top k)
        l   = sum_v q_v * (log q_v - log pi_v)

    The teacher is renormalised over its top k so that ``q`` is a distribution: ``l >= 0`` (the KL of
    ``q`` to pi restricted to the k tokens is ``>= -log pi(top k) >= 0``), ``l = 0`` exactly where pi
    puts ``q``'s mass on those tokens, and the gradient with respect to the policy's logits ``z``
    (log pi = log_softmax(z)) is ``pi - q`` (``q`` is 0 off the top k): the whole pull of the
    full-vocabulary forward KL, on the tokens the teacher ranks highest. Without the
    renormalisation the target would carry only the teacher's top-k mass and the gradient would be
    ``m * pi - p_teacher`` (``m`` that mass). With ``k`` = the vocabulary it is the full forward KL.
    Returns ``[...]``; the teacher's side carries no gradient."""
    teacher = torch.log_softmax(teacher_topk_logprobs.detach().float(), dim=-1)
    return (teacher.exp() * (teacher - student_topk_logprobs)).sum(-1)
