"""Pairwise preference losses (DPO and its variants, Bradley-Terry reward models) on per-pair
sequence scores.

For a pair (prompt ``x``, chosen ``y_w``, rejected ``y_l``) the policy and the frozen reference
give sequence log-probabilities; the *log-ratio* of a response is
``log pi(y|x) - log pi_ref(y|x)`` and the *margin* is
``h = logratio(y_w) - logratio(y_l)``. With ``beta > 0`` and label smoothing ``eps`` in [0, 0.5):

- ``sigmoid`` (DPO, conservative DPO when ``eps > 0``):
  ``-(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)``;
- ``ipo``: ``(h - 1 / (2 * beta))^2``;
- ``hinge`` (SLiC): ``max(0, 1 - beta * h)``;
- ``robust`` (rDPO, unbiased under label noise ``eps`` in (0, 0.5)):
  ``((1 - eps) * -log sigmoid(beta * h) - eps * -log sigmoid(-beta * h)) / (1 - 2 * eps)``;
- ``exo_pair`` (EXO with two responses, ``eps`` in (0, 0.5)): ``KL(q || p)`` between the policy's
  preference ``q = (sigmoid(beta * h), sigmoid(-beta * h))`` and the target ``p = (1 - eps, eps)``;

and on each response's own log-ratio ``r_w``, ``r_l`` (rewards ``u = beta * r``):

- ``nca_pair`` (NCA): ``-log sigmoid(u_w) - log sigmoid(-u_w) / 2 - log sigmoid(-u_l) / 2``;
- ``bco_pair`` (BCO without its running reward shift): ``-log sigmoid(u_w) - log sigmoid(-u_l)``;
- ``sppo_hard`` (SPPO with hard win probabilities): ``(r_w - 1 / (2 beta))^2 + (r_l + 1 / (2 beta))^2``;
- ``apo_zero`` (APO-zero): ``1 - sigmoid(u_w) + sigmoid(u_l)``;
- ``apo_down`` (APO-down): ``sigmoid(u_w) + 1 - sigmoid(beta * h)``;
- ``discopop`` (DiscoPOP's log-ratio modulated loss, temperature ``tau``): with ``z = beta * h``
  and ``s = sigmoid(z / tau)``, ``(1 - s) * -log sigmoid(z) + s * exp(-z)``.

The implicit rewards are ``beta * logratio`` of each response; a pair is *correct* when the
chosen reward exceeds the rejected one. A Bradley-Terry reward model is the ``sigmoid`` loss on
its two scalar scores with ``beta = 1`` (:func:`bradley_terry_loss`).

The reference-free losses (:data:`~core_rl.ops.names.REFERENCE_FREE_LOSSES`) read no reference:
they compare the policy's *length-normalised* log-probs ``a = log pi(y|x) / |y|`` (the mean over
the response tokens, :func:`mean_token_logprob`) of the chosen (``a_w``) and rejected (``a_l``)
responses:

- ``simpo`` (SimPO) with target margin ``gamma >= 0``, ``z = beta * (a_w - a_l) - gamma``:
  ``-(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z)`` (:func:`simpo_loss`);
- ``orpo`` (ORPO) with weight ``lam``: ``-a_w - lam * log sigmoid(o(a_w) - o(a_l))``, the chosen
  response's per-token NLL plus the odds-ratio term, with the log-odds ``o(a) = a - log(1 - e^a)``
  of the mean token probability ``e^a`` (:func:`log_odds`, :func:`orpo_loss`).

KTO (Kahneman-Tversky optimisation) needs no pairs: each row is one completion ``y`` of a prompt
``x`` labelled desirable or undesirable, with the log-ratio ``r = log pi(y|x) - log pi_ref(y|x)``.
Against the KL baseline ``z = max(0, mean_j (log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)))`` over
mismatched pairs (each prompt with another row's completion ``y'_j``; :func:`kto_kl_baseline`),
treated as a constant, a desirable row's loss is ``w_D * (1 - sigmoid(beta * (r - z)))`` and an
undesirable one's ``w_U * (1 - sigmoid(beta * (z - r)))`` (:func:`kto_loss`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from core_rl.ops.names import PREFERENCE_LOSSES

#: :func:`log_odds` reads a mean log-prob ``a`` above this as this: ``e^a`` of at most ``1 - 1e-6``
#: keeps ``log(1 - e^a)`` (``-inf`` at 0) and its derivative ``-e^a / (1 - e^a)`` finite
LOG_ODDS_MAX_LOGPROB = -1e-6


def smoothed_logistic_loss(x: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """``-(1 - eps) * log sigmoid(beta * x) - eps * log sigmoid(-beta * x)`` with
    ``eps = label_smoothing``: the logistic loss of the logit ``beta * x``, a fraction ``eps`` of the
    labels assumed flipped."""
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * x) - label_smoothing * F.logsigmoid(-beta * x)


def _check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")


def preference_loss(
    chosen_logratio: torch.Tensor,
    rejected_logratio: torch.Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
) -> torch.Tensor:
    """The per-pair loss ``[P]`` of :data:`PREFERENCE_LOSSES` (see the module docstring) from the
    chosen and rejected log-ratios ``[P]``. Differentiable in both arguments."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    _check_label_smoothing(label_smoothing)
    if loss_type in ("robust", "exo_pair") and label_smoothing <= 0:
        raise ValueError(f"the {loss_type} loss needs label_smoothing in (0, 0.5), got {label_smoothing}")
    margin = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        return smoothed_logistic_loss(margin, beta, label_smoothing)
    if loss_type == "ipo":
        return (margin - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * margin)
    if loss_type in _MARGIN_LOSSES:
        return _MARGIN_LOSSES[loss_type](beta * margin, label_smoothing, discopop_tau)
    if loss_type in _SEPARATE_LOSSES:
        return _SEPARATE_LOSSES[loss_type](chosen_logratio, rejected_logratio, beta)
    raise ValueError(f"unknown preference loss {loss_type!r}; one of {', '.join(PREFERENCE_LOSSES)}")


def _robust(z: torch.Tensor, eps: float, _tau: float) -> torch.Tensor:
    return (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)


def _exo_pair(z: torch.Tensor, eps: float, _tau: float) -> torch.Tensor:
    log_q_w, log_q_l = F.logsigmoid(z), F.logsigmoid(-z)
    return log_q_w.exp() * (log_q_w - math.log1p(-eps)) + log_q_l.exp() * (log_q_l - math.log(eps))


def _discopop(z: torch.Tensor, _eps: float, tau: float) -> torch.Tensor:
    # sigmoid(z / tau) * exp(-z) as one exponent: the product of 0 and an overflowing exp(-z) would be NaN
    return torch.sigmoid(-z / tau) * -F.logsigmoid(z) + torch.exp(F.logsigmoid(z / tau) - z)


#: the losses of ``z = beta * (r_w - r_l)`` (with ``label_smoothing`` and DiscoPOP's ``tau``)
_MARGIN_LOSSES = {"robust": _robust, "exo_pair": _exo_pair, "discopop": _discopop}


def _nca_pair(r_w: torch.Tensor, r_l: torch.Tensor, beta: float) -> torch.Tensor:
    u_w, u_l = beta * r_w, beta * r_l
    return -F.logsigmoid(u_w) - 0.5 * F.logsigmoid(-u_w) - 0.5 * F.logsigmoid(-u_l)


def _bco_pair(r_w: torch.Tensor, r_l: torch.Tensor, beta: float) -> torch.Tensor:
    return -F.logsigmoid(beta * r_w) - F.logsigmoid(-beta * r_l)


def _sppo_hard(r_w: torch.Tensor, r_l: torch.Tensor, beta: float) -> torch.Tensor:
    return (r_w - 0.5 / beta) ** 2 + (r_l + 0.5 / beta) ** 2


def _apo_zero(r_w: torch.Tensor, r_l: torch.Tensor, beta: float) -> torch.Tensor:
    return 1.0 - torch.sigmoid(beta * r_w) + torch.sigmoid(beta * r_l)


def _apo_down(r_w: torch.Tensor, r_l: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.sigmoid(beta * r_w) + 1.0 - torch.sigmoid(beta * (r_w - r_l))


#: the losses of each response's own log-ratio ``r_w``, ``r_l``
_SEPARATE_LOSSES = {
    "nca_pair": _nca_pair,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
}


def simpo_loss(
    chosen_mean_logprob: torch.Tensor,
    rejected_mean_logprob: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """SimPO's per-pair loss ``[P]``: with the length-normalised log-probs ``a_w``, ``a_l``
    (:func:`mean_token_logprob`) and ``z = beta * (a_w - a_l) - gamma``,
    ``-(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z)``. ``gamma`` is the target margin in
    reward units (``beta * a`` is a response's implicit reward), so the chosen mean log-prob must
    beat the rejected one by ``gamma / beta`` nats per token before the loss fades; with ``gamma =
    0`` it is the ``sigmoid`` loss of :func:`preference_loss` on ``a_w``, ``a_l`` without a
    reference. Differentiable in both arguments. (Computed as ``beta * (a_w - a_l - gamma / beta)``.)"""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    _check_label_smoothing(label_smoothing)
    return smoothed_logistic_loss(chosen_mean_logprob - rejected_mean_logprob - gamma / beta, beta, label_smoothing)


def log_odds(mean_logprob: torch.Tensor) -> torch.Tensor:
    """``o(a) = log(p / (1 - p)) = a - log(1 - e^a)``, the log-odds of ``p = e^a`` for a mean token
    log-prob ``a <= 0`` (ORPO). ``log(1 - e^a)`` is ``log(-expm1(a))`` for ``a > -log 2`` and
    ``log1p(-exp(a))`` below, each exact where the other loses digits (``1 - e^a`` rounds near
    ``a = 0``; ``exp(a)`` is tiny far below). ``a`` above :data:`LOG_ODDS_MAX_LOGPROB` counts as that
    bound (``o`` at most ``log(1e6) ~ 13.8``, no gradient there), so ``a = 0`` gives a finite value
    and gradient."""
    a = mean_logprob.clamp(max=LOG_ODDS_MAX_LOGPROB)
    log1m_exp = torch.where(a > -math.log(2.0), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))
    return a - log1m_exp


def orpo_loss(
    chosen_mean_logprob: torch.Tensor,
    rejected_mean_logprob: torch.Tensor,
    *,
    lam: float = 0.1,
) -> torch.Tensor:
    """ORPO's per-pair loss ``[P]``: ``-a_w - lam * log sigmoid(o(a_w) - o(a_l))`` with the
    length-normalised log-probs ``a_w``, ``a_l`` (:func:`mean_token_logprob`) and their log-odds
    ``o`` (:func:`log_odds`): the chosen response's mean per-token NLL plus ``lam`` times the
    odds-ratio term. ``lam = 0`` is supervised fine-tuning on the chosen responses.
    Differentiable in both arguments."""
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    odds_ratio = log_odds(chosen_mean_logprob) - log_odds(rejected_mean_logprob)
    return -chosen_mean_logprob - lam * F.logsigmoid(odds_ratio)


def bradley_terry_loss(
    chosen_score: torch.Tensor,
    rejected_score: torch.Tensor,
    *,
    margin: torch.Tensor | float = 0.0,
    label_smoothing: float = 0.0,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """``-log sigmoid(s_w - s_l)`` per pair ``[P]``: the negative log-likelihood that the chosen
    response wins under the Bradley-Terry model with scores ``s``. Options, each off at 0:

    - ``margin`` ``m`` (a number or one per pair): the chosen score must win by ``m``,
      ``d = s_w - s_l - m``;
    - ``label_smoothing`` ``eps`` in [0, 0.5): ``-(1 - eps) log sigmoid(d) - eps log sigmoid(-d)``;
    - ``center_coef`` ``c``: adds ``c * (s_w + s_l)^2``, which pulls the scores' mean to 0 without
      changing their differences' optimum.
    """
    if center_coef < 0:
        raise ValueError(f"center_coef must be >= 0, got {center_coef}")
    loss = preference_loss(
        chosen_score - margin, rejected_score, loss_type="sigmoid", beta=1.0, label_smoothing=label_smoothing
    )
    if center_coef:
        loss = loss + center_coef * (chosen_score + rejected_score) ** 2
    return loss


def preference_metrics(
    chosen_logratio: torch.Tensor,
    rejected_logratio: torch.Tensor,
    chosen_logprob: torch.Tensor,
    rejected_logprob: torch.Tensor,
    *,
    beta: float,
) -> dict[str, torch.Tensor]:
    """Per-pair ``[P]`` values worth reporting: implicit rewards ``beta * logratio`` of chosen and
    rejected (``rewards/chosen``, ``rewards/rejected``), their difference (``rewards/margin``),
    whether the chosen one is higher (``rewards/accuracy``, 0/1) and the policy's sequence
    log-probs (``logps/chosen``, ``logps/rejected``)."""
    chosen_reward = beta * chosen_logratio.detach()
    rejected_reward = beta * rejected_logratio.detach()
    return {
        "rewards/chosen": chosen_reward,
        "rewards/rejected": rejected_reward,
        "rewards/margin": chosen_reward - rejected_reward,
        "rewards/accuracy": (chosen_reward > rejected_reward).float(),
        "logps/chosen": chosen_logprob.detach(),
        "logps/rejected": rejected_logprob.detach(),
    }


def sequence_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t logprobs[b, t] * mask[b, t]``: the log-probability ``[B]`` of each row's masked tokens."""
    return (logprobs * mask).sum(dim=-1)


def mean_token_logprob(seq_logprob: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """``seq_logprob[b] / max(num_tokens[b], 1)``: the length-normalised log-prob ``[B]`` of each
    row (its sequence log-prob, :func:`sequence_logprob`, over its response token count; an empty
    response, whose sum is 0, gives 0). Differentiable in ``seq_logprob``."""
    return seq_logprob / num_tokens.to(seq_logprob.dtype).clamp(min=1.0)


def kto_kl_baseline(logratio_sum: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    """KTO's KL baseline ``z = max(0, S / n)``, a detached scalar: ``S`` the sum of the log-ratios
    ``log pi(y'|x) - log pi_ref(y'|x)`` of ``n`` mismatched (prompt, completion) pairs (both summed
    over every rank first, so ``z`` is their global mean). ``n = 0`` gives 0."""
    count = torch.as_tensor(count, dtype=logratio_sum.dtype)
    return (logratio_sum.detach() / count.clamp(min=1.0)).clamp(min=0.0)


def kto_loss(
    logratio: torch.Tensor,
    desirable: torch.Tensor,
    kl_baseline: torch.Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """KTO's per-row loss ``[B]`` from the log-ratios ``r`` ``[B]`` of the rows' completions, their
    labels ``desirable`` ``[B]`` (bool) and the KL baseline ``z`` (:func:`kto_kl_baseline`, no
    gradient flows into it):

    - desirable: ``w_D * (1 - sigmoid(beta * (r - z)))``;
    - undesirable: ``w_U * (1 - sigmoid(beta * (z - r)))``.

    Differentiable in ``logratio``: the loss falls as a desirable row's ``r`` rises above ``z`` and
    as an undesirable row's falls below it. (Computed as ``w * sigmoid(-s * beta * (r - z))`` with
    ``s = +1`` / ``-1``, since ``1 - sigmoid(x) = sigmoid(-x)``.)"""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(f"the weights must be >= 0, got {desirable_weight} and {undesirable_weight}")
    desirable = desirable.bool()
    z = torch.as_tensor(kl_baseline, dtype=logratio.dtype).detach()
    sign = torch.where(desirable, 1.0, -1.0).to(logratio.dtype)
    weight = torch.where(desirable, desirable_weight, undesirable_weight).to(logratio.dtype)
    return weight * torch.sigmoid(-sign * beta * (logratio - z))
