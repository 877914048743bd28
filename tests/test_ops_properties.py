"""Property tests (hypothesis) of core_rl.ops: invariants over varied inputs, and parity with the
loop-per-group / loop-per-sample reference formulations of core_rl.testing.reference."""

from __future__ import annotations

import math

import torch
from core_rl import ops
from core_rl.testing import reference
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def grouped_rewards(draw, *, allow_uniform_groups: bool = True):
    """Rewards [B] on a coarse grid (ties are common) and group labels in any order."""
    n = draw(st.integers(1, 24))
    rewards = draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]), min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return torch.tensor(rewards), torch.tensor(groups)


@st.composite
def padded_batch(draw):
    """A right-padded [B, T] mask with 1..T response tokens per row, and a seed for the values."""
    rows = draw(st.integers(1, 6))
    width = draw(st.integers(1, 7))
    starts = draw(st.lists(st.integers(0, width - 1), min_size=rows, max_size=rows))
    mask = torch.zeros(rows, width)
    for i, s in enumerate(starts):
        mask[i, s : s + draw(st.integers(1, width - s))] = 1.0
    return mask, draw(st.integers(0, 2**16))


@SETTINGS
@given(grouped_rewards(), st.booleans(), st.booleans(), st.floats(1e-6, 1.0))
def test_equal_rewards_in_a_group_give_zero_and_parity_with_the_group_loop(data, norm_std, loo, eps):
    rewards, groups = data
    got = ops.normalize(
        rewards,
        group_index=groups,
        mean_level="group",
        std_level="group" if norm_std else "none",
        leave_one_out=loo,
        eps=eps,
    )
    for label in groups.unique():
        members = groups == label
        if rewards[members].max() == rewards[members].min():
            assert (got[members] == 0).all()
    want = reference.group_advantages(rewards.tolist(), groups.tolist(), norm_std=norm_std, eps=eps, leave_one_out=loo)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(padded_batch(), st.floats(0.01, 10.0))
def test_m2po_keeps_the_smallest_second_moments_down_to_the_threshold(data, threshold):
    mask, seed = data
    g = torch.Generator().manual_seed(seed)
    behave, prox = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    keep = ops.m2po_mask(behave, prox, mask, threshold)
    on = mask != 0
    assert not (keep & ~on).any() and keep.sum() >= 1
    m2 = (behave - prox).square()
    assert keep[on].tolist() == reference.m2po_keep(m2[on].tolist(), threshold)
    if keep.sum() > 1:
        assert m2[keep].mean() < threshold
    if (~keep & on).any():
        assert m2[~keep & on].min() >= m2[keep].max()


@SETTINGS
@given(padded_batch(), st.sampled_from(["token", "sequence"]), st.sampled_from(["sum", "mean", "max"]))
def test_rejection_with_infinite_bounds_changes_nothing(data, level, agg):
    mask, seed = data
    g = torch.Generator().manual_seed(seed)
    prox, behave = torch.randn(mask.shape, generator=g) * 0.5, torch.randn(mask.shape, generator=g) * 0.5
    log_r = ops.behaviour_log_ratio(prox, behave)
    on = mask != 0
    for metric, log_space in (("ratio", True), ("kl_k1", False), ("kl_k3", False)):
        values = ops.divergence_metric(prox, behave, metric)
        for action in ("mask", "clamp") if log_space else ("mask",):
            lower = 0.0 if log_space else -math.inf
            weight, keep, clamped = ops.reject_by_metric(
                values, log_r, mask, level=level, action=action, agg=agg, upper=math.inf, lower=lower,
                log_space=log_space,
            )  # fmt: skip
            assert torch.equal(keep, on) and not clamped.any()
            if level == "token" or not log_space:
                torch.testing.assert_close(weight, log_r.exp() * mask)


@SETTINGS
@given(padded_batch(), st.booleans(), st.sampled_from([1.0, 0.9]))
def test_reinforce_pp_whitening_parity(data, group_baseline, gamma):
    mask, seed = data
    g = torch.Generator().manual_seed(seed)
    rows = mask.shape[0]
    rewards = torch.randint(0, 3, (rows,), generator=g).float()
    groups = torch.randint(0, 2, (rows,), generator=g)
    scores = rewards
    if group_baseline:
        scores = ops.normalize(rewards, group_index=groups, mean_level="group", std_level="none")
    got = ops.normalize(ops.discounted_outcome_returns(scores, mask, gamma), mask=mask, eps=1e-5)
    lengths = mask.sum(1).long().tolist()
    want = reference.reinforce_pp_advantages(
        rewards.tolist(), groups.tolist(), lengths, group_baseline=group_baseline, gamma=gamma, eps=1e-5
    )
    for i in range(rows):
        torch.testing.assert_close(got[i][mask[i] != 0], torch.tensor(want[i]), rtol=1e-4, atol=1e-5)
