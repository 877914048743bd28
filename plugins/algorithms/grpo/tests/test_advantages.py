"""Advantage estimators ``grpo`` and ``rloo`` against hand-computed values."""

from __future__ import annotations

import math

import core_rl_grpo.plugin as grpo_plugin
import pytest
import torch
from core_rl.config.checks import SectionContext
from core_rl.config.loader import structure
from core_rl.config.schema import RolloutConfig, RunConfig, SamplingConfig
from core_rl.errors import ConfigError
from core_rl.ops import group_is_uniform
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import ADVANTAGE
from core_rl.protocol import TensorBatch
from core_rl.testing import reference
from core_rl_grpo.advantages import group_relative_scores, grpo_advantages
from core_rl_grpo.config import GRPOAdvantageConfig, RLOOAdvantageConfig

EPS = 1e-6

# group 0: [0, 1, 1, 1]  mean 0.75; deviations -0.75, 0.25 x3;
#          unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25 -> std 0.5
# group 1: [2, 4]        mean 3; deviations -1, 1; var = 2 / 1 = 2 -> std sqrt(2)
# group 2: [5]           a group of one
REWARDS = torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0, 4.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 2])


def build(name: str, **options: object):
    host = PluginHost(entry_points=[])
    host.register_plugin(grpo_plugin, distribution="core-rl-grpo")
    entry = host.get(ADVANTAGE, name)
    return entry.factory(structure(options, entry.config_cls, path="algorithm.advantage"))


def scores(**kwargs: object) -> list[float]:
    return group_relative_scores(REWARDS, GROUPS, **kwargs).tolist()


def test_mean_baseline_std_normalised() -> None:
    s2 = math.sqrt(2.0)
    want = [-0.75 / (0.5 + EPS), 0.25 / (0.5 + EPS), 0.25 / (0.5 + EPS), 0.25 / (0.5 + EPS)]
    want += [-1 / (s2 + EPS), 1 / (s2 + EPS), 0.0]
    assert scores(norm_std=True, eps=EPS) == pytest.approx(want, rel=1e-6)


def test_mean_baseline_unnormalised() -> None:
    assert scores(norm_std=False) == pytest.approx([-0.75, 0.25, 0.25, 0.25, -1.0, 1.0, 0.0])


def test_leave_one_out_baseline() -> None:
    # group 0: b_0 = (1+1+1)/3 = 1 -> A = -1;  b_1..3 = (0+1+1)/3 = 2/3 -> A = 1/3
    # group 1: b_0 = 4 -> A = -2;  b_1 = 2 -> A = 2;   group 2: 0
    assert scores(norm_std=False, leave_one_out=True) == pytest.approx([-1, 1 / 3, 1 / 3, 1 / 3, -2, 2, 0])


def test_leave_one_out_std_normalised() -> None:
    s2 = math.sqrt(2.0)
    want = [-1 / (0.5 + EPS), (1 / 3) / (0.5 + EPS), (1 / 3) / (0.5 + EPS), (1 / 3) / (0.5 + EPS)]
    want += [-2 / (s2 + EPS), 2 / (s2 + EPS), 0.0]
    assert scores(norm_std=True, eps=EPS, leave_one_out=True) == pytest.approx(want, rel=1e-6)


def test_eps_is_added_to_std() -> None:
    # group [0, 1]: mean 0.5, std = sqrt(0.5) = 0.70710678; eps 0.5 -> A = -+0.5 / 1.20710678 = -+0.41421356
    got = group_relative_scores(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), eps=0.5)
    assert got.tolist() == pytest.approx([-0.41421356, 0.41421356], rel=1e-6)


def test_uniform_groups_get_exactly_zero() -> None:
    # 8 x 0.7 in float32: the computed mean is off by one ulp, so std is ~6e-8 and
    # (r - mean) / (std + eps) would be ~0.06 without the exact uniformity check
    rewards = torch.tensor([0.7] * 8 + [1.0, 1.0, 0.0])
    groups = torch.tensor([3] * 8 + [9, 9, 9])
    for loo in (False, True):
        got = group_relative_scores(rewards, groups, norm_std=True, leave_one_out=loo)
        assert (got[:8] == 0).all()
        assert (got[8:] != 0).all()


def test_group_of_one_is_zero() -> None:
    for loo in (False, True):
        for norm in (False, True):
            got = group_relative_scores(
                torch.tensor([3.0, -1.0]), torch.tensor([0, 1]), norm_std=norm, leave_one_out=loo
            )
            assert got.tolist() == [0.0, 0.0]


def test_group_is_uniform() -> None:
    got = group_is_uniform(torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 7.0]), torch.tensor([0, 0, 1, 1, 1, 5]))
    assert got.tolist() == [True, True, False, False, False, True]


def test_broadcast_to_response_tokens_only() -> None:
    # two samples of one group: rewards 0, 1 -> unnormalised A = -0.5, 0.5
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0]])
    got = grpo_advantages(torch.tensor([0.0, 1.0]), torch.tensor([4, 4]), mask, norm_std=False)
    assert got.tolist() == [[0.0, 0.0, -0.5, -0.5, 0.0], [0.0, 0.5, 0.5, 0.5, 0.5]]


def test_group_labels_need_not_be_contiguous_or_sorted() -> None:
    a = group_relative_scores(REWARDS, GROUPS, norm_std=True)
    perm = torch.tensor([6, 2, 4, 0, 5, 3, 1])
    relabel = torch.tensor([17, 17, 17, 17, -3, -3, 100])
    b = group_relative_scores(REWARDS[perm], relabel[perm], norm_std=True)
    torch.testing.assert_close(b, a[perm])


@pytest.mark.parametrize("norm_std", [False, True])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_parity_with_per_group_loop(norm_std: bool, leave_one_out: bool) -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 4, (40,), generator=g).float() / 3
    groups = torch.randint(0, 9, (40,), generator=g)
    got = group_relative_scores(rewards, groups, norm_std=norm_std, eps=EPS, leave_one_out=leave_one_out)
    want = reference.group_advantages(
        rewards.tolist(), groups.tolist(), norm_std=norm_std, eps=EPS, leave_one_out=leave_one_out
    )
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_invariants() -> None:
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(24, generator=g)
    groups = torch.arange(24) // 6
    a = group_relative_scores(rewards, groups, norm_std=False)
    # centred: advantages sum to zero within each group (also for leave-one-out: n/(n-1) * centred)
    for lo in (False, True):
        adv = group_relative_scores(rewards, groups, norm_std=False, leave_one_out=lo)
        torch.testing.assert_close(adv.view(4, 6).sum(1), torch.zeros(4), atol=1e-6, rtol=0)
    # normalised: unit (unbiased) std within each group, up to eps
    normed = group_relative_scores(rewards, groups, norm_std=True, eps=1e-12)
    torch.testing.assert_close(normed.view(4, 6).std(1), torch.ones(4), atol=1e-5, rtol=0)
    # shift invariance; scale invariance of the normalised form; rloo = n/(n-1) * mean-baseline
    torch.testing.assert_close(group_relative_scores(rewards + 3.0, groups, norm_std=False), a, atol=1e-5, rtol=0)
    torch.testing.assert_close(group_relative_scores(rewards * 10.0, groups, norm_std=True, eps=1e-12), normed)
    loo = group_relative_scores(rewards, groups, norm_std=False, leave_one_out=True)
    torch.testing.assert_close(loo, a * 6 / 5)


def test_estimators_read_the_batch() -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    batch = TensorBatch(
        {"rewards": torch.tensor([1.0, 0.0, 0.0]), "group_index": torch.tensor([0, 0, 0]), "response_mask": mask}
    )
    # mean 1/3; unbiased std = sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.57735027
    a = 2 / 3 / 0.57735027
    want_grpo = torch.tensor([[a, a], [-a / 2, 0.0], [0.0, -a / 2]])
    torch.testing.assert_close(build("grpo")(batch), want_grpo)
    # rloo: b_0 = 0 -> 1;  b_1 = b_2 = 1/2 -> -1/2
    want_rloo = torch.tensor([[1.0, 1.0], [-0.5, 0.0], [0.0, -0.5]])
    torch.testing.assert_close(build("rloo")(batch), want_rloo)
    torch.testing.assert_close(build("grpo", leave_one_out=True, norm_std=False)(batch), want_rloo)
    # rloo with norm_std: / sqrt(1/3)
    torch.testing.assert_close(build("rloo", norm_std=True)(batch), want_rloo / 0.57735027)


def test_config_defaults_and_errors() -> None:
    assert structure({}, GRPOAdvantageConfig) == GRPOAdvantageConfig(
        norm_std=True, eps=1e-6, leave_one_out=False, allow_single_sample_groups=False
    )
    assert structure({}, RLOOAdvantageConfig) == RLOOAdvantageConfig(norm_std=False, eps=1e-6)
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.eps: must be in \(0, 1\.0\]"):
        structure({"eps": 0.0}, GRPOAdvantageConfig, path="algorithm.advantage")
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.norm_std: expected true or false"):
        structure({"norm_std": "yes"}, GRPOAdvantageConfig, path="algorithm.advantage")
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.leave_one_out: unknown key"):
        structure({"leave_one_out": True}, RLOOAdvantageConfig, path="algorithm.advantage")


@pytest.mark.parametrize("config_cls", [GRPOAdvantageConfig, RLOOAdvantageConfig])
def test_groups_of_one_sample_are_refused_unless_allowed(config_cls: type) -> None:
    """With n = 1 every group is a single sample, so every advantage is exactly 0: nothing trains."""
    singles = torch.tensor([0.3, 0.9, 0.1])
    mask = torch.ones(3, 2)
    batch = TensorBatch({"rewards": singles, "group_index": torch.arange(3), "response_mask": mask})
    assert torch.count_nonzero(build("grpo")(batch)) == 0 and torch.count_nonzero(build("rloo")(batch)) == 0

    def problems(n: int, **options: object) -> list[str]:
        run = RunConfig(rollout=RolloutConfig(sampling=SamplingConfig(n=n)))
        context = SectionContext(path="algorithm.advantage", run=run, name="x")
        return structure(options, config_cls).check_config(context)

    assert problems(2) == [] and problems(1, allow_single_sample_groups=True) == []
    (problem,) = problems(1)
    assert problem.startswith("algorithm.advantage: 'x' compares the samples of each prompt's group")
    assert "algorithm.advantage.allow_single_sample_groups=true" in problem


# --------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_whitens_returns_over_the_batch() -> None:
    # rewards 1, 0, 0 with 2, 1, 1 response tokens: token returns [1, 1, 0, 0]: mean 0.5,
    # unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.8660 (eps 1e-5 added to the std)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    std = math.sqrt(1 / 3) + 1e-5
    batch = TensorBatch(
        {"rewards": torch.tensor([1.0, 0.0, 0.0]), "group_index": torch.tensor([0, 0, 1]), "response_mask": mask}
    )
    a = 0.5 / std
    torch.testing.assert_close(build("reinforce_pp")(batch), torch.tensor([[a, a], [-a, 0.0], [0.0, -a]]))
    # group baseline first: group 0 [1, 0] -> [0.5, -0.5]; group 1 [0] -> 0; then the token values
    # [0.5, 0.5, -0.5, 0] are whitened (torch's unbiased std)
    values = torch.tensor([0.5, 0.5, -0.5, 0.0])
    want = (values - values.mean()) / (values.std() + 1e-5)
    got = build("reinforce_pp", group_baseline=True)(batch)
    torch.testing.assert_close(got[mask != 0], want)


def test_reinforce_pp_discount_and_equal_rewards() -> None:
    # gamma 0.5, one sample, 3 tokens, reward 2: returns [0.5, 1, 2] -> whitened
    mask = torch.ones(1, 3)
    batch = TensorBatch({"rewards": torch.tensor([2.0]), "group_index": torch.tensor([0]), "response_mask": mask})
    returns = torch.tensor([0.5, 1.0, 2.0])
    want = (returns - returns.mean()) / (returns.std() + 1e-5)
    torch.testing.assert_close(build("reinforce_pp", gamma=0.5)(batch)[0], want)
    # equal rewards across the batch: exactly 0 (with or without the group baseline)
    equal = TensorBatch(
        {"rewards": torch.full((4,), 0.3), "group_index": torch.tensor([0, 0, 1, 1]), "response_mask": torch.ones(4, 2)}
    )
    for baseline in (False, True):
        assert (build("reinforce_pp", group_baseline=baseline)(equal) == 0).all()


def test_reinforce_pp_config() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.advantage\.gamma: must be in \(0\.0, 1\.0\]"):
        build("reinforce_pp", gamma=0.0)
