"""Tests of ``rank_advantage``: the conformance contract plus the formula on hand-computed cases and
against an independent (sort-based) reference implementation."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from core_rl.config.checks import SectionContext
from core_rl.config.loader import structure
from core_rl.config.schema import RolloutConfig, RunConfig, SamplingConfig
from core_rl.errors import ConfigError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ADVANTAGE
from core_rl.protocol import TensorBatch
from core_rl.testing import AdvantageEstimatorContract, installed_distribution, make_rl_batch
from core_rl_example_plugin import plugin
from core_rl_example_plugin.advantage import centred_rank_advantages
from core_rl_example_plugin.config import RankAdvantageConfig


class TestRankAdvantageContract(AdvantageEstimatorContract):
    plugin = plugin
    name = "rank_advantage"
    distribution = installed_distribution("core-rl-example-plugin")


class TestRankAdvantageScaledContract(AdvantageEstimatorContract):
    plugin = plugin
    name = "rank_advantage"
    distribution = installed_distribution("core-rl-example-plugin")
    options: ClassVar[dict[str, Any]] = {"scale": 2.0}


def reference(rewards: list[float], groups: list[int], scale: float = 1.0) -> list[float]:
    """The documented formula, computed by sorting each group (independent of the pairwise code)."""
    out = []
    for reward, group in zip(rewards, groups):
        members = sorted(r for r, g in zip(rewards, groups) if g == group)
        size = len(members)
        if size == 1:
            out.append(0.0)
            continue
        positions = [k + 1 for k, value in enumerate(members) if value == reward]
        rank = sum(positions) / len(positions)
        out.append(scale * (rank - (size + 1) / 2) / (size - 1))
    return out


def advantages(rewards: list[float], groups: list[int], scale: float = 1.0) -> list[float]:
    return centred_rank_advantages(torch.tensor(rewards), torch.tensor(groups), scale=scale).tolist()


def test_distinct_rewards_span_minus_half_to_half() -> None:
    # ranks 1, 3, 2 in a group of 3: (rank - 2) / 2
    assert advantages([0.1, 0.9, 0.5], [0, 0, 0]) == pytest.approx([-0.5, 0.5, 0.0])


def test_ties_share_their_average_rank() -> None:
    # ranks (3 + 4) / 2 = 3.5 for the two 1s and (1 + 2) / 2 = 1.5 for the 0s; (rank - 2.5) / 3
    assert advantages([1.0, 1.0, 0.0, 0.0], [0, 0, 0, 0]) == pytest.approx([1 / 3, 1 / 3, -1 / 3, -1 / 3])
    # ranks 1, 2.5, 2.5, 4 in a group of 4
    assert advantages([0.0, 0.5, 0.5, 1.0], [3, 3, 3, 3]) == pytest.approx([-0.5, 0.0, 0.0, 0.5])


def test_uniform_group_and_single_sample_group_get_zero() -> None:
    assert advantages([0.7, 0.7, 0.7, 5.0], [0, 0, 0, 1]) == [0.0, 0.0, 0.0, 0.0]


def test_interleaved_groups_with_arbitrary_labels() -> None:
    rewards = [3.0, 10.0, 1.0, 20.0, 2.0, 30.0]
    groups = [7, 2, 7, 2, 7, 2]
    # group 7: 3, 1, 2 -> ranks 3, 1, 2; group 2: 10, 20, 30 -> ranks 1, 2, 3
    assert advantages(rewards, groups) == pytest.approx([0.5, -0.5, -0.5, 0.0, 0.0, 0.5])


def test_scale_multiplies_advantages() -> None:
    assert advantages([0.0, 1.0, 2.0], [0, 0, 0], scale=2.0) == pytest.approx([-1.0, 0.0, 1.0])


@pytest.mark.parametrize("seed", range(5))
def test_matches_reference_with_many_ties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.randint(0, 4, (40,), generator=g) / 3.0).tolist()
    groups = torch.randint(0, 6, (40,), generator=g).tolist()
    assert advantages(rewards, groups, scale=1.5) == pytest.approx(reference(rewards, groups, scale=1.5), abs=1e-6)


def test_group_sums_vanish_and_values_are_bounded() -> None:
    g = torch.Generator().manual_seed(11)
    rewards = torch.randn(64, generator=g)
    groups = torch.arange(64) // 8
    adv = centred_rank_advantages(rewards, groups)
    sums = torch.zeros(8).index_add_(0, groups, adv)
    torch.testing.assert_close(sums, torch.zeros(8), atol=1e-6, rtol=0)
    assert adv.abs().max() <= 0.5 + 1e-7
    assert adv.dtype == torch.float32


def test_invariant_under_increasing_transformations_of_the_reward() -> None:
    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(32, generator=g)
    groups = torch.arange(32) // 4
    base = centred_rank_advantages(rewards, groups)
    torch.testing.assert_close(centred_rank_advantages(torch.exp(5 * rewards) - 3, groups), base)
    # GRPO's z-score would change under this transformation; ranks do not
    torch.testing.assert_close(centred_rank_advantages(rewards**3, groups), base)


def test_non_finite_rewards_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"rows \[1\] are NaN or infinite"):
        centred_rank_advantages(torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0, 0, 0]))


def test_estimator_from_the_registry_broadcasts_over_response_tokens() -> None:
    host = PluginHost(entry_points=[])
    host.register_plugin(plugin, distribution="core-rl-example-plugin")
    entry = host.get(ADVANTAGE, "rank_advantage")
    estimator = entry.factory(structure({"scale": 2.0}, entry.config_cls, path="algorithm.advantage"))
    batch: TensorBatch = make_rl_batch(batch_size=6, group_size=3, seed=4)
    batch["rewards"] = torch.tensor([0.2, 0.8, 0.5, 1.0, 1.0, 0.0])
    got = estimator(batch)
    per_sample = torch.tensor([-1.0, 1.0, 0.0, 0.5, 0.5, -1.0])  # scale 2 * centred ranks
    torch.testing.assert_close(got, per_sample[:, None] * batch["response_mask"])


def test_config_rejects_non_positive_scale() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.scale: must be > 0, got 0\.0"):
        structure({"scale": 0}, RankAdvantageConfig, path="algorithm.advantage")


def test_groups_of_one_sample_are_refused_unless_allowed() -> None:
    """A group of one always gets 0, so with rollout.sampling.n = 1 nothing would train."""
    run = RunConfig(rollout=RolloutConfig(sampling=SamplingConfig(n=1)))
    context = SectionContext(path="algorithm.advantage", run=run, name="rank_advantage")
    (problem,) = structure({}, RankAdvantageConfig).check_config(context)
    assert problem.startswith("algorithm.advantage: 'rank_advantage' compares the samples of each prompt's group")
    assert structure({"allow_single_sample_groups": True}, RankAdvantageConfig).check_config(context) == []
    run.rollout.sampling.n = 4
    assert structure({}, RankAdvantageConfig).check_config(context) == []
