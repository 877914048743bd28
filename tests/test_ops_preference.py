"""Preference losses (:mod:`core_rl.ops.preference`) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.ops import bradley_terry_loss, preference_loss, preference_metrics, sequence_logprob

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
