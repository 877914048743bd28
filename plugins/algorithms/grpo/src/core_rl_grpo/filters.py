"""Sample filter ``drop_uniform_groups``: drop groups whose rewards do not vary (dynamic sampling)."""

from __future__ import annotations

import torch
from core_rl.interfaces import SampleFilter
from core_rl.ops import group_is_uniform, group_mean_std
from core_rl.protocol import TensorBatch

from core_rl_grpo.config import DropUniformGroupsConfig


def varied_groups(rewards: torch.Tensor, group_index: torch.Tensor, *, min_std: float = 0.0) -> torch.Tensor:
    """Bool [B] keep-mask: ``keep_i = not uniform_g and std_g > min_std`` for the group ``g`` of ``i``.

    ``uniform_g``: every reward of the group is exactly equal (a group of one is uniform);
    ``std_g``: the unbiased group standard deviation, ``sqrt(sum_j (r_j - mean_g)^2 / (n - 1))``.
    Such groups carry no signal under group-relative advantages (every advantage is 0).
    """
    _, std, _ = group_mean_std(rewards, group_index)
    return ~group_is_uniform(rewards, group_index) & (std > min_std)


class DropUniformGroups(SampleFilter):
    """Keeps the samples of groups whose rewards vary; reads ``rewards`` and ``group_index``."""

    def __init__(self, config: DropUniformGroupsConfig | None = None) -> None:
        self.config = config if config is not None else DropUniformGroupsConfig()

    def __call__(self, batch: TensorBatch) -> torch.Tensor:
        return varied_groups(batch["rewards"], batch["group_index"], min_std=self.config.min_std)
