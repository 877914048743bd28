"""Preference losses (:mod:`core_rl.ops.preference`) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.ops import (
    LOG_ODDS_MAX_LOGPROB,
    bradley_terry_loss,
    kto_kl_baseline,
    kto_loss,
    log_odds,
    mean_token_logprob,
    orpo_loss,
    preference_loss,
    preference_metrics,
    sequence_logprob,
    simpo_loss,
)
from hypothesis import given, settings
from hypothesis import strategies as st

CHOSEN = torch.tensor([1.0, -0.5])
REJECTED = torch.tensor([0.0, 0.5])  # margins h = [1, -1]


def test_sigmoid_loss_by_hand() -> None:
    # beta h = [0.5, -0.5]: -log sigmoid(0.5) = log(1 + e^-0.5) = 0.474077, -log sigmoid(-0.5) = 0.974077
    loss = preference_loss(CHOSEN, REJECTED, loss_type="sigmoid", beta=0.5)
    assert loss.tolist() == pytest.approx([0.474077, 0.974077], abs=1e-6)
    assert loss[0].item() == pytest.approx(math.log1p(math.exp(-0.5)), abs=1e-7)


def test_label_smoothing_by_hand() -> None:
    # 0.9 * 0.474077 + 0.1 * 0.974077 and 0.9 * 0.974077 + 0.1 * 0.474077
    loss = preference_loss(CHOSEN, REJECTED, loss_type="sigmoid", beta=0.5, label_smoothing=0.1)
    assert loss.tolist() == pytest.approx([0.524077, 0.924077], abs=1e-6)


def test_ipo_loss_by_hand() -> None:
    # target margin 1 / (2 beta) = 1: (1 - 1)^2 = 0, (-1 - 1)^2 = 4
    assert preference_loss(CHOSEN, REJECTED, loss_type="ipo", beta=0.5).tolist() == pytest.approx([0.0, 4.0])
    # beta 0.25: target 2: (1 - 2)^2 = 1, (-1 - 2)^2 = 9
    assert preference_loss(CHOSEN, REJECTED, loss_type="ipo", beta=0.25).tolist() == pytest.approx([1.0, 9.0])


def test_hinge_loss_by_hand() -> None:
    # max(0, 1 - 0.5 * 1) = 0.5, max(0, 1 + 0.5) = 1.5; beta 2: max(0, 1 - 2) = 0, 1 + 2 = 3
    assert preference_loss(CHOSEN, REJECTED, loss_type="hinge", beta=0.5).tolist() == pytest.approx([0.5, 1.5])
    assert preference_loss(CHOSEN, REJECTED, loss_type="hinge", beta=2.0).tolist() == pytest.approx([0.0, 3.0])


def test_sigmoid_gradient_by_hand() -> None:
    # d/dh [-log sigmoid(beta h)] = -beta sigmoid(-beta h); at h = 1, beta = 0.5: -0.5 * 0.377541
    chosen = CHOSEN.clone().requires_grad_(True)
    preference_loss(chosen, REJECTED, loss_type="sigmoid", beta=0.5).sum().backward()
    assert chosen.grad.tolist() == pytest.approx([-0.188771, -0.5 * 0.622459], abs=1e-6)


def test_bradley_terry_by_hand() -> None:
    # -log sigmoid(2 - 0) = log(1 + e^-2) = 0.126928; equal scores: log 2
    loss = bradley_terry_loss(torch.tensor([2.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert loss.tolist() == pytest.approx([0.126928, math.log(2)], abs=1e-6)


def test_bradley_terry_margin_smoothing_and_centering_by_hand() -> None:
    chosen, rejected = torch.tensor([2.0, 1.0]), torch.tensor([0.0, 1.0])
    # margins [1, -1]: d = [2 - 0 - 1, 1 - 1 + 1] = [1, 1]; -log sigmoid(1) = log(1 + e^-1) = 0.313262
    loss = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, -1.0]))
    assert loss.tolist() == pytest.approx([0.313262, 0.313262], abs=1e-6)
    # eps 0.1, d = 2: 0.9 log(1 + e^-2) + 0.1 log(1 + e^2) = 0.9 * 0.126928 + 0.1 * 2.126928 = 0.326928
    assert bradley_terry_loss(chosen[:1], rejected[:1], label_smoothing=0.1).item() == pytest.approx(0.326928, abs=1e-6)
    # c 0.01: + 0.01 (s_w + s_l)^2 = + 0.04 for both pairs; dL/ds_w of pair 0 = -sigmoid(-2) + 2 * 0.01 * 2
    s_w = chosen.clone().requires_grad_(True)
    loss = bradley_terry_loss(s_w, rejected, center_coef=0.01)
    assert loss.tolist() == pytest.approx([0.166928, math.log(2) + 0.04], abs=1e-6)
    loss.sum().backward()
    assert s_w.grad[0].item() == pytest.approx(-0.119203 + 0.04, abs=1e-6)
    with pytest.raises(ValueError, match="center_coef"):
        bradley_terry_loss(chosen, rejected, center_coef=-1.0)


def test_metrics_by_hand() -> None:
    m = preference_metrics(CHOSEN, REJECTED, torch.tensor([-3.0, -4.0]), torch.tensor([-5.0, -2.0]), beta=0.5)
    assert m["rewards/chosen"].tolist() == pytest.approx([0.5, -0.25])
    assert m["rewards/rejected"].tolist() == pytest.approx([0.0, 0.25])
    assert m["rewards/margin"].tolist() == pytest.approx([0.5, -0.5])
    assert m["rewards/accuracy"].tolist() == [1.0, 0.0]
    assert m["logps/chosen"].tolist() == [-3.0, -4.0] and m["logps/rejected"].tolist() == [-5.0, -2.0]


def test_sequence_logprob_sums_masked_tokens() -> None:
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -9.0], [0.0, -0.5, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert sequence_logprob(logprobs, mask).tolist() == [-3.0, -0.5]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"beta": 0.0}, "beta"), ({"label_smoothing": 0.5}, "label_smoothing"), ({"loss_type": "nope"}, "nope")],
)
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        preference_loss(CHOSEN, REJECTED, **kwargs)


# --- reference-free losses: SimPO and ORPO on length-normalised log-probs -------------------------


def test_mean_token_logprob_by_hand() -> None:
    # sums [-3, -0.5] over 2 and 1 tokens: [-1.5, -0.5]; an empty response (sum 0) gives 0, not nan
    means = mean_token_logprob(torch.tensor([-3.0, -0.5, 0.0]), torch.tensor([2, 1, 0]))
    assert means.tolist() == [-1.5, -0.5, 0.0]


def test_simpo_loss_by_hand() -> None:
    chosen, rejected = torch.tensor([-0.5, -1.0]), torch.tensor([-1.0, -0.75])
    # beta 2, gamma 0.5: z = 2 * 0.5 - 0.5 = 0.5 and 2 * -0.25 - 0.5 = -1
    # -log sigmoid(0.5) = log(1 + e^-0.5) = 0.474077; -log sigmoid(-1) = log(1 + e) = 1.313262
    loss = simpo_loss(chosen, rejected, beta=2.0, gamma=0.5)
    assert loss.tolist() == pytest.approx([0.474077, 1.313262], abs=1e-6)
    # eps 0.1: 0.9 * 0.474077 + 0.1 * 0.974077 = 0.524077; 0.9 * 1.313262 + 0.1 * 0.313262 = 1.213262
    loss = simpo_loss(chosen, rejected, beta=2.0, gamma=0.5, label_smoothing=0.1)
    assert loss.tolist() == pytest.approx([0.524077, 1.213262], abs=1e-6)
    # d/da_w at z = 0.5: -beta * sigmoid(-0.5) = -2 * 0.377541 = -0.755081
    a_w = chosen.clone().requires_grad_(True)
    simpo_loss(a_w, rejected, beta=2.0, gamma=0.5).sum().backward()
    assert a_w.grad[0].item() == pytest.approx(-0.755081, abs=1e-6)


def test_log_odds_by_hand() -> None:
    # p = 0.5, 0.2, 0.8: log(p / (1 - p)) = 0, -log 4 = -1.386294, log 4 = 1.386294
    odds = log_odds(torch.log(torch.tensor([0.5, 0.2, 0.8])))
    assert odds.tolist() == pytest.approx([0.0, -1.386294, 1.386294], abs=1e-6)
    # p = 1 (a = 0) reads as a = -1e-6: -1e-6 - log(1 - e^-1e-6) = log(1e6) = 13.815511 (to 1e-6 relative)
    assert log_odds(torch.tensor([0.0])).item() == pytest.approx(13.815510, abs=1e-4)
    assert LOG_ODDS_MAX_LOGPROB == -1e-6


def test_orpo_loss_by_hand() -> None:
    # pair 0: p_w = 0.5, p_l = 0.2: NLL -log 0.5 = 0.693147; o_w - o_l = 0 + log 4;
    #   -log sigmoid(log 4) = log(1 + 1/4) = 0.223144; lam 0.1: 0.693147 + 0.022314 = 0.715461
    # pair 1: p_w = 0.2, p_l = 0.8: NLL -log 0.2 = 1.609438; o_w - o_l = -2 log 4 = -log 16;
    #   -log sigmoid(-log 16) = log(1 + 16) = 2.833213; lam 0.1: 1.609438 + 0.283321 = 1.892759
    chosen = torch.log(torch.tensor([0.5, 0.2])).requires_grad_(True)
    rejected = torch.log(torch.tensor([0.2, 0.8]))
    loss = orpo_loss(chosen, rejected, lam=0.1)
    assert loss.tolist() == pytest.approx([0.715461, 1.892759], abs=1e-6)
    # lam 0.5, pair 1: 1.609438 + 0.5 * 2.833213 = 3.026045; lam 0: the NLL alone
    assert orpo_loss(chosen, rejected, lam=0.5)[1].item() == pytest.approx(3.026045, abs=1e-6)
    assert orpo_loss(chosen, rejected, lam=0.0).tolist() == pytest.approx([0.693147, 1.609438], abs=1e-6)
    # d/da_w = -1 - lam * sigmoid(-(o_w - o_l)) * do/da with do/da = 1 / (1 - p):
    #   pair 0: -1 - 0.1 * sigmoid(-log 4) * 2 = -1 - 0.1 * 0.2 * 2 = -1.04
    #   pair 1: -1 - 0.1 * sigmoid(log 16) * 1.25 = -1 - 0.1 * (16/17) * 1.25 = -1.117647
    loss.sum().backward()
    assert chosen.grad.tolist() == pytest.approx([-1.04, -1.117647], abs=1e-6)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: simpo_loss(CHOSEN, REJECTED, beta=0.0), "beta"),
        (lambda: simpo_loss(CHOSEN, REJECTED, gamma=-0.1), "gamma"),
        (lambda: simpo_loss(CHOSEN, REJECTED, label_smoothing=0.5), "label_smoothing"),
        (lambda: orpo_loss(CHOSEN, REJECTED, lam=-1.0), "lam"),
    ],
)
def test_bad_reference_free_arguments_are_refused(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


PROPERTY = settings(max_examples=60, deadline=None)
LOGPROBS = st.floats(-20.0, 0.0, width=32)


@PROPERTY
@given(
    st.lists(st.tuples(LOGPROBS, LOGPROBS, st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=6),
    st.floats(0.01, 10.0),
    st.sampled_from([0.0, 0.1, 0.3]),
)
def test_simpo_without_margin_is_the_sigmoid_loss_on_mean_logprobs_without_a_reference(pairs, beta, eps):
    """SimPO with gamma 0 equals DPO's sigmoid loss on the length-normalised log-probs with a zero
    reference; a margin gamma shifts the rejected mean by gamma / beta and never lowers the loss."""
    # a row of n tokens with mean log-prob a has the sequence log-prob a * n
    sums_w = torch.tensor([p[0] * p[2] for p in pairs])
    sums_l = torch.tensor([p[1] * p[3] for p in pairs])
    a_w = mean_token_logprob(sums_w, torch.tensor([p[2] for p in pairs]))
    a_l = mean_token_logprob(sums_l, torch.tensor([p[3] for p in pairs]))
    zero = torch.zeros_like(a_w)
    want = preference_loss(a_w - zero, a_l - zero, loss_type="sigmoid", beta=beta, label_smoothing=eps)
    got = simpo_loss(a_w, a_l, beta=beta, gamma=0.0, label_smoothing=eps)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    shifted = preference_loss(a_w, a_l + 0.5 / beta, loss_type="sigmoid", beta=beta, label_smoothing=eps)
    torch.testing.assert_close(
        simpo_loss(a_w, a_l, beta=beta, gamma=0.5, label_smoothing=eps), shifted, rtol=1e-4, atol=1e-5
    )
    if eps == 0.0:
        assert bool((simpo_loss(a_w, a_l, beta=beta, gamma=0.5) >= got).all())


@PROPERTY
@given(st.floats(-64.0, -(2.0**-13), width=32))
def test_log_odds_agree_with_the_float64_formula_away_from_zero(a):
    """``a - log(1 - e^a)`` in float32 matches the direct float64 formula on the same input."""
    want = a - math.log(1.0 - math.exp(a))
    assert log_odds(torch.tensor([a])).item() == pytest.approx(want, rel=2e-6, abs=1e-5)


@PROPERTY
@given(st.floats(-(2.0**-13), 0.0, width=32), st.floats(-64.0, -(2.0**-13), width=32))
def test_log_odds_and_orpo_stay_finite_near_zero(a, other):
    """A mean log-prob at or next to 0 (a response the model is certain of) gives a finite
    log-odds at most log(1e6), finite ORPO losses and finite gradients, on either side of a pair."""
    x = torch.tensor([a, other], requires_grad=True)
    odds = log_odds(x)
    assert torch.isfinite(odds).all() and odds[0].item() <= math.log(1e6) + 1e-3
    assert odds[0].item() >= odds[1].item()  # monotone: the likelier response has the higher odds
    loss = orpo_loss(x[:1], x[1:], lam=1.0) + orpo_loss(x[1:], x[:1], lam=1.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(x.grad).all()


# --- KTO: unpaired rows against the KL baseline -----------------------------------------------

# log-ratios r, labels (desirable or not), baseline z = 1, beta 0.5
KTO_R = [2.0, -2.0, 1.0, 0.0]
KTO_DESIRABLE = torch.tensor([True, False, False, True])


def test_kto_loss_by_hand() -> None:
    # desirable r = 2: 1 - sigmoid(0.5 * (2 - 1)) = 1 - sigmoid(0.5) = 1 - 0.622459 = 0.377541
    # undesirable r = -2: 1 - sigmoid(0.5 * (1 - -2)) = 1 - sigmoid(1.5) = 1 - 0.817574 = 0.182426
    # undesirable r = 1 = z: 1 - sigmoid(0) = 0.5; desirable r = 0: 1 - sigmoid(-0.5) = 0.622459
    r = torch.tensor(KTO_R, dtype=torch.float64, requires_grad=True)
    loss = kto_loss(r, KTO_DESIRABLE, torch.tensor(1.0), beta=0.5)
    assert loss.tolist() == pytest.approx([0.377541, 0.182426, 0.5, 0.622459], abs=1e-6)
    # w_D 2, w_U 0.5: [2 * 0.377541, 0.5 * 0.182426, 0.5 * 0.5, 2 * 0.622459]
    weighted = kto_loss(r, KTO_DESIRABLE, 1.0, beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    assert weighted.tolist() == pytest.approx([0.755081, 0.091213, 0.25, 1.244919], abs=1e-6)
    # d/dr: desirable -beta * s (1 - s) at s = sigmoid(beta (r - z)); undesirable +beta * s (1 - s) at
    # s = sigmoid(beta (z - r)): sigmoid(0.5) (1 - sigmoid(0.5)) = 0.235004 -> -0.117502;
    # sigmoid(1.5) (1 - sigmoid(1.5)) = 0.149146 -> +0.074573; at 0: 0.25 -> +0.125
    loss.sum().backward()
    assert r.grad.tolist() == pytest.approx([-0.117502, 0.074573, 0.125, -0.117502], abs=1e-6)


def test_kto_kl_baseline_by_hand() -> None:
    # mean of the mismatched log-ratios, floored at 0: 1.5 / 3 = 0.5; -3 / 3 = -1 -> 0; no pairs -> 0
    assert kto_kl_baseline(torch.tensor(1.5), torch.tensor(3.0)).item() == 0.5
    assert kto_kl_baseline(torch.tensor(1.5), 3).item() == 0.5
    assert kto_kl_baseline(torch.tensor(-3.0), 3).item() == 0.0
    assert kto_kl_baseline(torch.tensor(0.0), 0).item() == 0.0
    # a constant: no gradient flows into the baseline, through it or through the loss
    total = torch.tensor(3.0, requires_grad=True)
    z = kto_kl_baseline(total, 2)
    assert z.item() == 1.5 and not z.requires_grad
    r = torch.tensor(KTO_R)
    assert not kto_loss(r, KTO_DESIRABLE, total, beta=0.5).requires_grad


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"beta": 0.0}, "beta"), ({"desirable_weight": -1.0}, "weights"), ({"undesirable_weight": -0.1}, "weights")],
)
def test_bad_kto_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kto_loss(torch.tensor(KTO_R), KTO_DESIRABLE, 0.0, **kwargs)


@PROPERTY
@given(
    st.lists(st.tuples(st.floats(-20.0, 20.0), st.booleans()), min_size=1, max_size=8),
    st.floats(0.0, 10.0),
    st.floats(0.01, 2.0),
    st.floats(0.05, 4.0),
    st.floats(0.05, 4.0),
)
def test_kto_gradient_raises_desirable_rewards_and_lowers_undesirable_ones(rows, z, beta, w_d, w_u):
    """Gradient descent on the KTO loss raises every desirable row's log-ratio (reward ``beta * r``)
    and lowers every undesirable one's: ``dL/dr <= 0`` and ``>= 0``, strictly wherever the sigmoid
    is not saturated (``|beta (r - z)| < 30``; float64); each row's loss is within ``[0, w]`` and
    falls after a small step against the gradient (where ``|beta (r - z)| < 10``)."""
    r = torch.tensor([row[0] for row in rows], dtype=torch.float64, requires_grad=True)
    desirable = torch.tensor([row[1] for row in rows])
    weights = {"desirable_weight": w_d, "undesirable_weight": w_u}
    loss = kto_loss(r, desirable, z, beta=beta, **weights)
    weight = torch.where(desirable, w_d, w_u).double()
    assert bool(((loss >= 0) & (loss <= weight)).all())
    loss.sum().backward()
    grad, logit = r.grad, beta * (r.detach() - z)
    push = torch.where(desirable, -grad, grad)  # > 0 where descent raises a desirable r, lowers an undesirable one
    assert bool((push >= 0).all()) and bool((push[logit.abs() < 30] > 0).all()), grad
    stepped = r.detach() - 1e-3 * torch.sign(grad)  # a step of 1e-3 against the gradient
    live = logit.abs() < 10
    assert bool((stepped[desirable & live] > r.detach()[desirable & live]).all())
    assert bool((stepped[~desirable & live] < r.detach()[~desirable & live]).all())
    after = kto_loss(stepped, desirable, z, beta=beta, **weights)
    assert bool((after[live] < loss.detach()[live]).all())
