"""Shared algorithm math (core_rl.ops) against hand-computed values, one test per formula."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl import ops
from core_rl.ops import aggregation_weights, group_mean_std, kl_estimate, masked_mean

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # lengths 2 and 3, N = 2
LOSS = torch.tensor([[1.0, 3.0, 100.0], [2.0, 4.0, 6.0]])
E = math.e


def close(got: torch.Tensor, want, **kw) -> None:
    torch.testing.assert_close(got.detach().float(), torch.as_tensor(want, dtype=torch.float32), **kw)


# --------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 3 + 2 + 4 + 6) / 5),  # 3.2
        ("seq-mean-token-mean", ((1 + 3) / 2 + (2 + 4 + 6) / 3) / 2),  # (2 + 4) / 2 = 3
        ("seq-mean-token-sum", ((1 + 3) + (2 + 4 + 6)) / 2),  # 8
        ("seq-mean-token-sum-norm", ((1 + 3) + (2 + 4 + 6)) / (2 * 8)),  # C = 8: 16 / 16 = 1
    ],
)
def test_aggregation_hand_values(mode, expected):
    w = aggregation_weights(MASK, mode, norm_length=8)
    assert (w * LOSS).sum().item() == pytest.approx(expected)
    assert (w[MASK == 0] == 0).all()


def test_aggregation_is_split_invariant_and_sum_norm_needs_its_constant():
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        w = aggregation_weights(MASK, mode, norm_length=4)
        whole = (w * LOSS).sum()
        parts = (w[:1] * LOSS[:1]).sum() + (w[1:] * LOSS[1:]).sum()
        assert torch.isclose(whole, parts)
    # the constant does not follow the padded width: a wider batch weighs its tokens the same
    wide = torch.cat([MASK, torch.zeros(2, 5)], dim=1)
    w_wide = aggregation_weights(wide, "seq-mean-token-sum-norm", norm_length=4)
    torch.testing.assert_close(w_wide[:, :3], aggregation_weights(MASK, "seq-mean-token-sum-norm", norm_length=4))
    with pytest.raises(ValueError, match="needs a positive norm_length"):
        aggregation_weights(MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregation_weights(MASK, "mean")


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_values():
    lp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([-0.5, -1.0])  # d = 0.5, 0
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.0])
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, 0.0])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_k3_far_below_the_reference_is_capped_with_zero_gradient():
    # d = -1:  k3 = e - 2 = 0.71828, dk3/dd = 1 - e^{1} = -1.71828   (exact: below the cap)
    # d = -3:  exact k3 = e^3 - 4 = 16.0855 > 10 -> 10, gradient 0
    # d = -25: exact k3 = e^25 - 26 ~ 7.2e10 -> 10, gradient 0 (the old clamp inside exp gave
    #          e^20 - 26 and gradient +1, the wrong sign)
    # d = 12:  k3 = e^-12 - 1 + 12 = 11.000006 -> 10, gradient 0
    d = torch.tensor([-1.0, -3.0, -25.0, 12.0, 0.5], requires_grad=True)
    k3 = kl_estimate(d, torch.zeros(5), "k3")
    k3.sum().backward()
    close(k3, [E - 2, 10.0, 10.0, 10.0, math.exp(-0.5) - 0.5])
    close(d.grad, [1 - E, 0.0, 0.0, 0.0, 1 - math.exp(-0.5)])


def test_uncapped_k3_is_exact_and_k1_k2_caps():
    d = torch.tensor([-3.0], requires_grad=True)
    k3 = kl_estimate(d, torch.zeros(1), "k3", cap=None)
    k3.backward()
    close(k3, [E**3 - 4], rtol=1e-6, atol=1e-5)
    close(d.grad, [1 - E**3], rtol=1e-6, atol=1e-5)
    close(kl_estimate(torch.tensor([-12.0, 3.0]), torch.zeros(2), "k1"), [-10.0, 3.0])
    close(kl_estimate(torch.tensor([5.0]), torch.zeros(1), "k2"), [10.0])  # 12.5 capped
    close(kl_estimate(torch.tensor([5.0]), torch.zeros(1), "k2", cap=None), [12.5])


def test_k3_is_non_negative_and_k1_unbiased_in_expectation():
    torch.manual_seed(0)
    p = torch.distributions.Categorical(logits=torch.randn(6))
    q = torch.distributions.Categorical(logits=torch.randn(6))
    x = p.sample((200_000,))
    exact = torch.distributions.kl_divergence(p, q).item()
    d_lp, d_ref = p.log_prob(x), q.log_prob(x)
    assert (kl_estimate(d_lp, d_ref, "k3") >= -1e-7).all()
    assert kl_estimate(d_lp, d_ref, "k1").mean().item() == pytest.approx(exact, abs=0.02)
    assert kl_estimate(d_lp, d_ref, "k3").mean().item() == pytest.approx(exact, abs=0.02)


# --------------------------------------------------------------------------- statistics


def test_group_mean_std():
    values = torch.tensor([1.0, 3.0, 5.0, 2.0])
    groups = torch.tensor([7, 7, 7, 9])
    mean, std, count = group_mean_std(values, groups)
    assert mean.tolist() == [3.0, 3.0, 3.0, 2.0]
    assert std.tolist() == pytest.approx([2.0, 2.0, 2.0, 0.0])  # unbiased std of 1,3,5 is 2
    assert count.tolist() == [3.0, 3.0, 3.0, 1.0]
    _, biased, _ = group_mean_std(values, groups, unbiased=False)
    assert biased.tolist() == pytest.approx([math.sqrt(8 / 3)] * 3 + [0.0])


def test_masked_mean():
    assert masked_mean(LOSS, MASK).item() == pytest.approx(3.2)
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0


def test_normalize_batch_and_group_levels():
    r = torch.tensor([0.0, 1.0, 2.0, 5.0])
    g = torch.tensor([0, 0, 1, 1])
    # batch: mean 2, unbiased var (4+1+0+9)/3 = 14/3
    s = math.sqrt(14 / 3)
    close(ops.normalize(r, eps=0.0), [-2 / s, -1 / s, 0.0, 3 / s])
    # biased: var 14/4
    b = math.sqrt(3.5)
    close(ops.normalize(r, unbiased=False, eps=0.0), [-2 / b, -1 / b, 0.0, 3 / b])
    # group means 0.5, 3.5; group stds sqrt(0.5), sqrt(4.5); eps 0.1 added to the std
    s0, s1 = math.sqrt(0.5) + 0.1, math.sqrt(4.5) + 0.1
    close(
        ops.normalize(r, group_index=g, mean_level="group", std_level="group", eps=0.1),
        [-0.5 / s0, 0.5 / s0, -1.5 / s1, 1.5 / s1],
    )
    # group mean, batch std; centring only; scaling only
    close(ops.normalize(r, group_index=g, mean_level="group", eps=0.0), [-0.5 / s, 0.5 / s, -1.5 / s, 1.5 / s])
    close(ops.normalize(r, group_index=g, mean_level="group", std_level="none"), [-0.5, 0.5, -1.5, 1.5])
    close(ops.normalize(r, mean_level="none", eps=0.0), [0.0, 1 / s, 2 / s, 5 / s])


def test_normalize_leave_one_out():
    # group [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> -3, -1.5, 4.5
    r = torch.tensor([1.0, 2.0, 6.0, 7.0])
    g = torch.tensor([3, 3, 3, 8])  # a group of one has no other member: it is uniform -> 0
    close(
        ops.normalize(r, group_index=g, mean_level="group", std_level="none", leave_one_out=True),
        [-3.0, -1.5, 4.5, 0.0],
    )


def test_normalize_tokens_count_once_and_uniform_sets_are_zero():
    # [B, T] with a mask: sample 0 has tokens [1, 1], sample 1 [4]: batch mean (1+1+4)/3 = 2
    values = torch.tensor([[1.0, 1.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # unbiased var over the 3 tokens: (1 + 1 + 4) / 2 = 3
    s = math.sqrt(3.0)
    close(ops.normalize(values, mask=mask, eps=0.0), [[-1 / s, -1 / s, 0.0], [2 / s, 0.0, 0.0]])
    # leave-one-out over samples: sample 0's baseline is sample 1's mean (4), sample 1's is 1
    close(
        ops.normalize(values, mask=mask, mean_level="batch", std_level="none", leave_one_out=True),
        [[-3.0, -3.0, 0.0], [3.0, 0.0, 0.0]],
    )
    # 8 x 0.7 in float32: the computed mean is off by one ulp; centring must still give exactly 0
    r = torch.tensor([0.7] * 8 + [1.0, 0.0])
    g = torch.tensor([1] * 8 + [2, 2])
    out = ops.normalize(r, group_index=g, mean_level="group", std_level="group", eps=1e-6)
    assert (out[:8] == 0).all() and (out[8:] != 0).all()
    assert ops.group_is_uniform(r, g).tolist() == [True] * 8 + [False, False]


def test_masked_whiten():
    values = torch.tensor([[1.0, 3.0], [5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # tokens 1, 3, 5: mean 3, unbiased std 2
    close(ops.masked_whiten(values, mask, eps=0.0), [[-1.0, 0.0], [1.0, 0.0]])


# --------------------------------------------------------------------------- ratios


def test_sequence_reduce_and_sequence_ratio():
    values = torch.tensor([[1.0, -2.0, 7.0], [0.5, 0.5, 0.5]])
    close(ops.sequence_reduce(values, MASK, "sum"), [-1.0, 1.5])
    close(ops.sequence_reduce(values, MASK, "mean"), [-0.5, 0.5])
    close(ops.sequence_reduce(values, MASK, "max"), [1.0, 0.5])
    old = torch.zeros(2, 3)
    close(ops.sequence_log_ratio(values, old, MASK), [-0.5, 0.5])
    with pytest.raises(ValueError, match="unknown sequence reduction"):
        ops.sequence_reduce(values, MASK, "median")


def test_policy_ratio_clamps_the_log_ratio():
    close(ops.policy_ratio(torch.tensor([math.log(2.0), 100.0]), torch.zeros(2)), [2.0, math.exp(20.0)])


def test_gspo_token_ratio_value_and_gradient():
    # log-ratios [ln 2, ln 0.5, (masked) 3] -> sequence log-ratio mean(ln 2, -ln 2) = 0 -> s = 1;
    # row 2: log-ratios [ln 4, 0, 0] over 3 tokens -> s = 4^(1/3)
    lp = torch.tensor([[math.log(2.0), math.log(0.5), 3.0], [math.log(4.0), 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    log_s = ops.gspo_token_log_ratio(lp, old, MASK)
    s2 = 4 ** (1 / 3)
    close(log_s.exp() * MASK, [[1.0, 1.0, 0.0], [s2, s2, s2]])
    # d/d lp_t of sum_t exp(log s_{i,t}) = s_i for each token (the stop-gradient form)
    (log_s.exp() * MASK).sum().backward()
    close(lp.grad, [[1.0, 1.0, 0.0], [s2, s2, s2]])


def test_importance_log_ratio_levels_agree_on_one_token():
    lp = torch.tensor([[0.0, -1.2], [0.0, -0.3]])
    old = torch.tensor([[0.0, -1.0], [0.0, -0.9]])
    mask = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    token = ops.importance_log_ratio(lp, old, mask, "token")
    seq = ops.importance_log_ratio(lp, old, mask, "sequence")
    close(token[:, 1], [-0.2, 0.6])
    torch.testing.assert_close(seq[:, 1], token[:, 1])


# --------------------------------------------------------------------------- surrogates


def test_ppo_clip_loss_hand_values():
    # eps 0.2 / 0.28: r 1.5 A 1 -> -1.28 clipped; r 0.5 A -1 -> 0.8 clipped; r 5 A -1, c 3 -> 3 dual
    loss, clipped, dual = ops.ppo_clip_loss(
        torch.tensor([1.5, 0.5, 5.0, 1.1]), torch.tensor([1.0, -1.0, -1.0, 2.0]), eps_low=0.2, eps_high=0.28, c_clip=3
    )
    close(loss, [-1.28, 0.8, 3.0, -2.2])
    assert clipped.tolist() == [True, True, False, False] and dual.tolist() == [False, False, True, False]


def test_sapo_gate_hand_values():
    # f(r) = 4/tau sigmoid(tau (r - 1)); tau 1 for A > 0, 2 for A <= 0
    #   r 1, A 1:  f = 2             -> l = -2;     gate 4 s (1 - s) = 1
    #   r 2, A 1:  s = sigmoid(1)    -> l = -4 s;   gate 4 s (1 - s)
    #   r 1.5, A -2: tau 2, s = sigmoid(1) -> l = 2 * 2 * s; gate 4 s (1 - s)
    s1 = 1 / (1 + math.exp(-1))
    r = torch.tensor([1.0, 2.0, 1.5], requires_grad=True)
    a = torch.tensor([1.0, 1.0, -2.0])
    loss, gate = ops.sapo_loss(r, a, tau_pos=1.0, tau_neg=2.0)
    close(loss, [-2.0, -4 * s1, 4 * s1])
    close(gate, [1.0, 4 * s1 * (1 - s1), 4 * s1 * (1 - s1)])
    loss.sum().backward()
    close(r.grad, -a * gate)  # d l / d r = -A f'(r) = -A gate


def test_cispo_hand_values():
    # eps_low 0.2, eps_high 0.28: w = clip(r, 0.8, 1.28) = [0.8, 1, 1.28, 1.28]; l = -A w;
    # d l / d log r = -A w (the clipped weight, never 0 as PPO's clip gives)
    log_r = torch.log(torch.tensor([0.5, 1.0, 1.5, 3.0])).requires_grad_(True)
    a = torch.tensor([1.0, -1.0, 2.0, -1.0])
    loss, truncated = ops.cispo_loss(log_r.exp(), a, eps_low=0.2, eps_high=0.28)
    close(loss, [-0.8, 1.0, -2.56, 1.28])
    assert truncated.tolist() == [True, False, True, True]
    loss.sum().backward()
    close(log_r.grad, [-0.8, 1.0, -2.56, 1.28])


def test_off_policy_sequence_mask_hand_values():
    # row 0: A < 0, mean(behave - lp) = mean(0.5, 0.3) = 0.4 > 0.3 -> dropped
    # row 1: A < 0, mean = 0.1 -> kept;  row 2: A > 0, mean 0.9 -> kept (only negative advantages)
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    behave = torch.tensor([[-0.5, -0.7], [-0.9, -0.9], [-0.1, -0.1]])
    adv = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    keep = ops.off_policy_sequence_mask(lp, behave, adv, mask, 0.3)
    assert keep.tolist() == [[False, False], [True, True], [True, False]]


@pytest.mark.parametrize(
    ("threshold", "kept"),
    [
        # m2 = [4, 1, 0.25, 0.01]: mean 1.315 >= 0.5, drop 4 -> mean(1, .25, .01) = 0.42 < 0.5
        (0.5, [False, True, True, True]),
        # drop 4 (0.42), drop 1 -> mean(.25, .01) = 0.13 >= 0.1, drop .25 -> 0.01 < 0.1
        (0.1, [False, False, False, True]),
        # nothing reaches 0.001: every token but the smallest is dropped
        (0.001, [False, False, False, True]),
        (2.0, [True, True, True, True]),
    ],
)
def test_m2po_mask_hand_values(threshold, kept):
    behave = torch.tensor([[2.0, 1.0], [0.5, 0.1]])
    prox = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    assert ops.m2po_mask(behave, prox, mask, threshold).flatten().tolist() == kept


def test_loglinear_proximal_hand_values():
    # train version 5 (prox = 4): v_b 4 -> alpha 0; 3 -> 1/2; 1 -> 3/4; -1 (prompt) -> 0; 5 -> 0
    behave = torch.zeros(1, 5)
    current = torch.full((1, 5), -4.0)
    versions = torch.tensor([[4, 3, 1, -1, 5]])
    out = ops.loglinear_proximal_logprobs(behave, current, versions, torch.tensor([5]))
    close(out, [[0.0, -2.0, -3.0, 0.0, 0.0]])


# --------------------------------------------------------------------------- importance weights


def test_reject_by_metric_token_and_sequence():
    # log r per token: row 0 [ln 3, ln 0.4], row 1 [ln 1.5, ln 1.5]
    log_r = torch.log(torch.tensor([[3.0, 0.4], [1.5, 1.5]]))
    mask = torch.ones(2, 2)
    common = {"agg": "mean", "upper": 2.0, "lower": 0.5, "log_space": True}
    w, keep, clamped = ops.reject_by_metric(log_r, log_r, mask, level="token", action="mask", **common)
    close(w, [[3.0, 0.4], [1.5, 1.5]])
    assert keep.tolist() == [[False, False], [True, True]] and not clamped.any()
    w, keep, clamped = ops.reject_by_metric(log_r, log_r, mask, level="token", action="clamp", **common)
    close(w, [[2.0, 0.5], [1.5, 1.5]])
    assert keep.all() and clamped.tolist() == [[True, True], [False, False]]
    # sequence, geometric mean: row 0 sqrt(1.2) = 1.0954 (kept), row 1 1.5 (kept); weight = that
    w, keep, _ = ops.reject_by_metric(log_r, log_r, mask, level="sequence", action="mask", **common)
    close(w, [[math.sqrt(1.2)] * 2, [1.5, 1.5]])
    assert keep.all()
    # sequence, product: 1.2 and 2.25 (> 2: row 1 rejected);  max: 3 and 1.5
    _, keep, _ = ops.reject_by_metric(log_r, log_r, mask, level="sequence", action="mask", **{**common, "agg": "sum"})
    assert keep.tolist() == [[True, True], [False, False]]
    w, keep, _ = ops.reject_by_metric(log_r, log_r, mask, level="sequence", action="mask", **{**common, "agg": "max"})
    close(w, [[3.0, 3.0], [1.5, 1.5]])
    assert keep.tolist() == [[False, False], [True, True]]


def test_reject_by_kl_metric():
    # k3 of r = 3: 3 - ln 3 - 1 = 0.9014; of r = 0.4: 0.4 - ln 0.4 - 1 = 0.3163 -> upper 0.5
    prox = torch.log(torch.tensor([[3.0, 0.4]]))
    behave = torch.zeros(1, 2)
    values = ops.divergence_metric(prox, behave, "kl_k3")
    close(values, [[3 - math.log(3) - 1, 0.4 - math.log(0.4) - 1]])
    w, keep, _ = ops.reject_by_metric(
        values, ops.behaviour_log_ratio(prox, behave), torch.ones(1, 2),
        level="token", action="mask", agg="mean", upper=0.5, lower=None, log_space=False,
    )  # fmt: skip
    close(w, [[3.0, 0.4]])  # weights stay the token ratios
    assert keep.tolist() == [[False, True]]
    close(ops.divergence_metric(prox, behave, "kl_k2"), [[math.log(3) ** 2 / 2, math.log(0.4) ** 2 / 2]])
    with pytest.raises(ValueError, match="needs a ratio metric"):
        ops.reject_by_metric(
            values, values, torch.ones(1, 2),
            level="token", action="clamp", agg="mean", upper=0.5, lower=None, log_space=False,
        )  # fmt: skip


# --------------------------------------------------------------------------- rewards


def test_overlong_penalty_hand_values():
    # L_max 10, L_cache 4: free up to 6; 7 -> -1/4; 8 -> -2/4; 10 -> -1; 11 -> -1 (floor); factor 0.5
    got = ops.overlong_penalty(torch.tensor([5, 6, 7, 8, 10, 11]), max_new_tokens=10, overlong_tokens=4, factor=0.5)
    close(got, [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


def test_scale_rewards_and_discounted_returns():
    close(ops.scale_rewards(torch.tensor([1.0, -3.0, 0.5]), scale=2.0, bias=0.5, clip=2.5), [2.5, -2.5, 2.0])
    close(ops.scale_rewards(torch.tensor([1.0]), scale=2.0, bias=0.5, clip=None), [3.0])
    # gamma 0.5: row 0 has 3 response tokens at positions 1..3 -> 0.25, 0.5, 1 (times 2)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    close(
        ops.discounted_outcome_returns(torch.tensor([2.0, -1.0]), mask, 0.5),
        [[0.0, 0.5, 1.0, 2.0], [-0.5, -1.0, 0.0, 0.0]],
    )
