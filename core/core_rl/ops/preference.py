"""Pairwise preference losses (DPO and its variants, Bradley-Terry reward models) on per-pair
sequence scores.

For a pair (prompt ``x``, chosen ``y_w``, rejected ``y_l``) the policy and the frozen reference
give sequence log-probabilities; the *log-ratio* of a response is
``log pi(y|x) - log pi_ref(y|x)`` and the *margin* is
``h = logratio(y_w) - logratio(y_l)``. With ``beta > 0`` and label smoothing ``eps`` in [0, 0.5):

- ``sigmoid`` (DPO, conservative DPO when ``eps > 0``):
  ``-(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)``;
- ``ipo``: ``(h - 1 / (2 * beta))^2``;
- ``hinge`` (SLiC): ``max(0, 1 - beta * h)``.

The implicit rewards are ``beta * logratio`` of each response; a pair is *correct* when the
chosen reward exceeds the rejected one. A Bradley-Terry reward model is the ``sigmoid`` loss on
its two scalar scores with ``beta = 1`` (:func:`bradley_terry_loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core_rl.ops.names import PREFERENCE_LOSSES


def preference_loss(
    chosen_logratio: torch.Tensor,
    rejected_logratio: torch.Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The per-pair loss ``[P]`` of :data:`PREFERENCE_LOSSES` (see the module docstring) from the
    chosen and rejected log-ratios ``[P]``. Differentiable in both arguments."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    margin = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        return -(1.0 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    if loss_type == "ipo":
        return (margin - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * margin)
    raise ValueError(f"unknown preference loss {loss_type!r}; one of {', '.join(PREFERENCE_LOSSES)}")


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
