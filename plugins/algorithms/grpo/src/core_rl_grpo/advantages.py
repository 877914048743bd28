"""Group-relative advantage estimators: ``grpo`` (group mean baseline, optionally divided by the group
standard deviation) and ``rloo`` (leave-one-out baseline, no normalisation).

Outcome rewards are scalars per sample; every response token of a sample gets the sample's advantage.
"""

from __future__ import annotations

import attrs
import torch
from core_rl.config.checks import SectionContext, group_size_problems
from core_rl.config.validators import positive
from core_rl.interfaces import AdvantageEstimator
from core_rl.ops import group_ids_to_dense, group_mean_std
from core_rl.protocol import TensorBatch


def group_is_uniform(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Bool [B]: True where every member of the sample's group holds exactly the same value,
    i.e. ``max_{j in g} v_j == min_{j in g} v_j`` (always true for a group of one).

    Exact comparison, unlike ``std == 0``, which rounding in the mean can break (e.g. three 0.1s).
    """
    dense, n_groups = group_ids_to_dense(group_index)
    v = values.float()
    gmax = torch.full((n_groups,), float("-inf"), device=v.device).scatter_reduce(0, dense, v, "amax")
    gmin = torch.full((n_groups,), float("inf"), device=v.device).scatter_reduce(0, dense, v, "amin")
    return (gmax == gmin)[dense]


def group_relative_scores(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
    leave_one_out: bool = False,
) -> torch.Tensor:
    """Per-sample advantages [B] from scalar rewards [B] and group labels [B].

    For sample ``i`` of group ``g`` with ``n = |g|`` members and rewards ``r``::

        mean_g = (1/n) * sum_{j in g} r_j
        std_g  = sqrt( sum_{j in g} (r_j - mean_g)^2 / (n - 1) )      # unbiased (Bessel), as torch.std
        b_i    = mean_g                                   if not leave_one_out
        b_i    = (sum_{j in g} r_j - r_i) / (n - 1)       if leave_one_out   (mean of the *other* members)
        A_i    = r_i - b_i                                # leave_one_out: A_i = n/(n-1) * (r_i - mean_g)
        A_i    = A_i / (std_g + eps)                      if norm_std

    A group whose rewards are all equal (including a group of one) gets exactly ``A_i = 0``: it carries
    no relative signal, and forcing the zero keeps rounding in ``mean_g`` from leaking
    ``O(ulp) / eps`` noise.
    """
    r = rewards.detach().float()
    mean, std, count = group_mean_std(r, group_index)
    centred = r - mean
    if leave_one_out:
        centred = centred * count / (count - 1.0).clamp(min=1.0)
    if norm_std:
        centred = centred / (std + eps)
    return torch.where(group_is_uniform(r, group_index), torch.zeros_like(centred), centred)


def broadcast_to_response(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] advantages: ``A_{i,t} = scores_i * response_mask_{i,t}``."""
    return scores.to(response_mask.device)[:, None] * response_mask.float()


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
    leave_one_out: bool = False,
) -> torch.Tensor:
    """Token-level advantages [B, T]: :func:`group_relative_scores` broadcast over each response."""
    scores = group_relative_scores(rewards, group_index, norm_std=norm_std, eps=eps, leave_one_out=leave_one_out)
    return broadcast_to_response(scores, response_mask)


@attrs.define
class GRPOAdvantageConfig:
    """``algorithm.advantage`` options of ``grpo``.

    ``norm_std``: divide by the group's (unbiased) standard deviation; ``eps`` (in (0, 1]): added to
    it; ``leave_one_out``: baseline is the mean of the other group members instead of the group
    mean. ``allow_single_sample_groups``: accept ``rollout.sampling.n: 1``, where every advantage is
    0 (refused otherwise: nothing would train).
    """

    norm_std: bool = True
    eps: float = attrs.field(default=1e-6, validator=positive(1.0))
    leave_one_out: bool = False
    allow_single_sample_groups: bool = False

    def check_config(self, context: SectionContext) -> list[str]:
        return group_size_problems(
            context, allowed=self.allow_single_sample_groups, option="allow_single_sample_groups"
        )


@attrs.define
class RLOOAdvantageConfig:
    """``algorithm.advantage`` options of ``rloo`` (the baseline is always leave-one-out).

    ``norm_std``: also divide by the group's (unbiased) standard deviation; ``eps`` (in (0, 1]):
    added to it; ``allow_single_sample_groups``: as for ``grpo``.
    """

    norm_std: bool = False
    eps: float = attrs.field(default=1e-6, validator=positive(1.0))
    allow_single_sample_groups: bool = False

    def check_config(self, context: SectionContext) -> list[str]:
        return group_size_problems(
            context, allowed=self.allow_single_sample_groups, option="allow_single_sample_groups"
        )


class GroupRelativeAdvantage(AdvantageEstimator):
    """Reads ``rewards``, ``group_index`` and ``response_mask``; see :func:`group_relative_scores`."""

    def __init__(self, *, norm_std: bool = True, eps: float = 1e-6, leave_one_out: bool = False) -> None:
        self.norm_std = norm_std
        self.eps = eps
        self.leave_one_out = leave_one_out

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        return grpo_advantages(
            batch["rewards"],
            batch["group_index"],
            batch["response_mask"],
            norm_std=self.norm_std,
            eps=self.eps,
            leave_one_out=self.leave_one_out,
        )


def make_grpo(config: GRPOAdvantageConfig) -> GroupRelativeAdvantage:
    return GroupRelativeAdvantage(norm_std=config.norm_std, eps=config.eps, leave_one_out=config.leave_one_out)


def make_rloo(config: RLOOAdvantageConfig) -> GroupRelativeAdvantage:
    return GroupRelativeAdvantage(norm_std=config.norm_std, eps=config.eps, leave_one_out=True)
