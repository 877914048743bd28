"""Sample filter ``drop_uniform_groups`` against hand-computed values."""

from __future__ import annotations

import math

import core_rl_grpo.plugin as grpo_plugin
import pytest
import torch
from core_rl.config.checks import SectionContext
from core_rl.config.loader import structure
from core_rl.config.schema import RolloutConfig, RunConfig, SamplingConfig
from core_rl.errors import ConfigError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import SAMPLE_FILTER
from core_rl.protocol import TensorBatch
from core_rl_grpo.advantages import group_relative_scores
from core_rl_grpo.config import DropUniformGroupsConfig
from core_rl_grpo.filters import varied_groups


def build(**options: object):
    host = PluginHost(entry_points=[])
    host.register_plugin(grpo_plugin, distribution="core-rl-grpo")
    entry = host.get(SAMPLE_FILTER, "drop_uniform_groups")
    return entry.factory(structure(options, entry.config_cls, path="algorithm.filters[0]"))


# group 0: [1, 1, 1]        uniform                          -> drop
# group 1: [0, 1, 0]        std = sqrt((1/9+4/9+1/9)/2) = 0.57735  -> keep
# group 2: [0.5]            a group of one                   -> drop
# group 3: [0.2, 0.3]       std = sqrt(2 * 0.05^2 / 1) = 0.070711   -> keep (min_std 0), drop (min_std 0.1)
# group 4: [0.7] * 8        uniform; float32 rounding gives a computed std of ~6e-8  -> drop
REWARDS = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.2, 0.3] + [0.7] * 8)
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 2, 3, 3] + [4] * 8)


def batch() -> TensorBatch:
    return TensorBatch({"rewards": REWARDS, "group_index": GROUPS})


def test_drops_uniform_groups_and_singletons() -> None:
    keep = build()(batch())
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] + [True] * 2 + [False] * 8


@pytest.mark.parametrize(
    ("min_std", "group3_kept", "group1_kept"),
    [(0.07, True, True), (0.0708, False, True), (0.1, False, True), (0.6, False, False)],
)
def test_min_std_threshold(min_std: float, group3_kept: bool, group1_kept: bool) -> None:
    keep = build(min_std=min_std)(batch())
    assert keep[3:6].tolist() == [group1_kept] * 3
    assert keep[7:9].tolist() == [group3_kept] * 2
    assert not keep[:3].any() and not keep[6] and not keep[9:].any()


def test_parity_with_per_group_loop() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (60,), generator=g).float() / 2
    groups = torch.randint(0, 20, (60,), generator=g)
    for min_std in (0.0, 0.3):
        got = varied_groups(rewards, groups, min_std=min_std)
        for label in groups.unique():
            idx = (groups == label).nonzero().flatten()
            r = [float(rewards[i]) for i in idx]
            n = len(r)
            std = math.sqrt(sum((x - sum(r) / n) ** 2 for x in r) / (n - 1)) if n > 1 else 0.0
            want = max(r) != min(r) and std > min_std
            assert got[idx].tolist() == [want] * n


def test_kept_rows_are_exactly_those_with_nonzero_advantage() -> None:
    keep = build()(batch())
    assert torch.equal(keep, group_relative_scores(REWARDS, GROUPS) != 0)


def test_config() -> None:
    assert structure({}, DropUniformGroupsConfig) == DropUniformGroupsConfig(min_std=0.0)
    with pytest.raises(ConfigError, match=r"algorithm\.filters\[0\]\.min_std: must be >= 0"):
        build(min_std=-0.5)


def test_groups_of_one_sample_are_refused() -> None:
    """Every group of one is uniform, so n = 1 would drop every sample of every step."""
    singles = TensorBatch({"rewards": torch.tensor([0.0, 1.0]), "group_index": torch.tensor([0, 1])})
    assert not build()(singles).any()
    config = structure({}, DropUniformGroupsConfig)
    run = RunConfig(rollout=RolloutConfig(sampling=SamplingConfig(n=1)))
    (problem,) = config.check_config(SectionContext(path="algorithm.filters[0]", run=run, name="drop_uniform_groups"))
    assert problem == (
        "algorithm.filters[0]: 'drop_uniform_groups' compares the samples of each prompt's group, but "
        "rollout.sampling.n is 1, so every group holds one sample and nothing would train; set rollout.sampling.n "
        "to 2 or more"
    )
    run.rollout.sampling.n = 2
    assert config.check_config(SectionContext(path="algorithm.filters[0]", run=run)) == []
