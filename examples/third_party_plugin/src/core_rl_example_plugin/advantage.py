"""``rank_advantage``: group-relative advantages from the centred, normalised rank of each reward.

The samples answering one prompt form a group (``group_index``). Within a group of ``G`` samples with
rewards ``r_1 .. r_G``, each reward gets its *average rank* (ties share the mean of the ranks they
span, so equal rewards get equal advantages)::

    rank_i = 1 + #{j : r_j < r_i} + (#{j : r_j == r_i} - 1) / 2          (1 <= rank_i <= G)

and the advantage of every response token of sample ``i`` is that rank normalised to ``[0, 1]`` and
centred::

    A_i = scale * ((rank_i - 1) / (G - 1) - 1/2) = scale * (rank_i - (G + 1) / 2) / (G - 1)

A group of one sample gets ``A = 0``. Because the average ranks of a group always sum to
``G (G + 1) / 2``, the advantages of a group sum to exactly 0; they lie in ``[-scale/2, scale/2]``
(the extremes are reached by a unique best and a unique worst reward). A group whose rewards are all
equal gets 0 everywhere, as with GRPO's mean-centred advantages.

This is the centred rank transformation of Salimans et al. (2017), *Evolution Strategies as a
Scalable Alternative to Reinforcement Learning* (ranks mapped linearly onto ``[-0.5, 0.5]``), applied
per group and with tied ranks averaged. Unlike GRPO's ``(r - mean) / std`` it depends only on the
order of the rewards: it is unchanged by any strictly increasing transformation of the reward, is
bounded, and one outlier reward cannot shrink the other advantages of its group.
"""

from __future__ import annotations

import torch
from core_rl.interfaces import AdvantageEstimator
from core_rl.ops import group_ids_to_dense
from core_rl.protocol import TensorBatch

from core_rl_example_plugin.config import RankAdvantageConfig


def average_ranks(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Average rank of each reward within its group, and the size of that group.

    :param rewards: [B] rewards.
    :param group_index: [B] group label of each sample (any integers; groups need not be contiguous).
    :return: ``(ranks, sizes)``, two float [B] tensors; ``ranks`` lie in ``[1, sizes]`` and tied
        rewards share the mean of the ranks they span.

    Compares all pairs of samples, so it takes O(B^2) memory: a few MB for ``B`` in the thousands.
    """
    dense, _ = group_ids_to_dense(group_index)
    values = rewards.to(torch.float64)
    same_group = dense[:, None] == dense[None, :]
    below = ((values[None, :] < values[:, None]) & same_group).sum(dim=1)
    tied = ((values[None, :] == values[:, None]) & same_group).sum(dim=1)  # includes the sample itself
    ranks = 1.0 + below.to(torch.float64) + (tied.to(torch.float64) - 1.0) / 2.0
    return ranks, same_group.sum(dim=1).to(torch.float64)


def centred_rank_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """Per-sample advantages ``scale * (rank - (G + 1) / 2) / (G - 1)`` (0 for a group of one).

    :param rewards: [B] finite rewards.
    :param group_index: [B] group label of each sample.
    :param scale: multiplies the advantages.
    :return: float32 [B] advantages, summing to 0 within each group.
    :raises ValueError: if a reward is NaN or infinite (its rank would be meaningless).
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_index must be [B] tensors of the same shape, got {tuple(rewards.shape)} "
            f"and {tuple(group_index.shape)}"
        )
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rank_advantage needs finite rewards; rows {bad} are NaN or infinite")
    ranks, sizes = average_ranks(rewards, group_index)
    centred = (ranks - (sizes + 1.0) / 2.0) / (sizes - 1.0).clamp(min=1.0)
    return (scale * centred).to(torch.float32)


class RankAdvantage(AdvantageEstimator):
    """The ``rank_advantage`` estimator: :func:`centred_rank_advantages` broadcast over each
    sample's response tokens (0 off the response mask)."""

    def __init__(self, config: RankAdvantageConfig) -> None:
        self.config = config

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        """Advantages [B, T] from ``rewards`` [B], ``group_index`` [B] and ``response_mask`` [B, T]."""
        per_sample = centred_rank_advantages(batch["rewards"], batch["group_index"], scale=self.config.scale)
        mask = batch["response_mask"]
        return per_sample.to(mask.device)[:, None] * mask.to(torch.float32)
