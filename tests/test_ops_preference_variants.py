"""The preference losses beyond sigmoid/ipo/hinge (:mod:`core_rl.ops.preference`): hand values at
``r_w = 0.5``, ``r_l = -0.5``, written with ``math`` apart from the torch code, and properties:
``robust`` is unbiased under its label noise, ``exo_pair`` vanishes where the policy's preference
equals the target, ``sppo_hard`` at ``r = +-1 / (2 beta)``."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl.ops import preference_loss
from hypothesis import given, settings
from hypothesis import strategies as st


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def loss(loss_type: str, r_w: float = 0.5, r_l: float = -0.5, **options: float) -> float:
    out = preference_loss(
        torch.tensor([r_w], dtype=torch.float64),
        torch.tensor([r_l], dtype=torch.float64),
        loss_type=loss_type,
        **options,
    )
    return float(out[0])


@pytest.mark.parametrize(
    ("loss_type", "options", "expected"),
    [
        # z = beta * (r_w - r_l) = 1; -log sigmoid(z) = softplus(-z)
        ("robust", {"beta": 1.0, "label_smoothing": 0.1}, (0.9 * softplus(-1) - 0.1 * softplus(1)) / 0.8),
        (
            "exo_pair",
            {"beta": 1.0, "label_smoothing": 0.1},
            sigmoid(1) * math.log(sigmoid(1) / 0.9) + sigmoid(-1) * math.log(sigmoid(-1) / 0.1),
        ),
        ("nca_pair", {"beta": 1.0}, softplus(-0.5) + 0.5 * softplus(0.5) + 0.5 * softplus(-0.5)),
        ("bco_pair", {"beta": 1.0}, 2 * softplus(-0.5)),
        ("sppo_hard", {"beta": 0.5}, (0.5 - 1.0) ** 2 + (-0.5 + 1.0) ** 2),
        ("apo_zero", {"beta": 1.0}, 1 - sigmoid(0.5) + sigmoid(-0.5)),
        ("apo_down", {"beta": 1.0}, sigmoid(0.5) + 1 - sigmoid(1.0)),
        ("discopop", {"beta": 1.0, "discopop_tau": 1.0}, (1 - sigmoid(1)) * softplus(-1) + sigmoid(1) * math.exp(-1)),
    ],
)
def test_by_hand(loss_type: str, options: dict[str, float], expected: float) -> None:
    assert loss(loss_type, **options) == pytest.approx(expected, rel=1e-12)


@given(z=st.floats(-8, 8), eps=st.floats(0.01, 0.45))
@settings(max_examples=50, deadline=None)
def test_robust_is_unbiased_under_its_label_noise(z: float, eps: float) -> None:
    """Labels flipped with probability eps: the expected robust loss is the clean DPO loss."""
    options = {"beta": 1.0, "label_smoothing": eps}
    expected = (1 - eps) * loss("robust", z, 0.0, **options) + eps * loss("robust", -z, 0.0, **options)
    assert expected == pytest.approx(loss("sigmoid", z, 0.0, beta=1.0), rel=1e-9, abs=1e-12)


@given(eps=st.floats(0.001, 0.45), dz=st.floats(-3, 3))
@settings(max_examples=50, deadline=None)
def test_exo_pair_is_a_divergence_from_the_target_preference(eps: float, dz: float) -> None:
    target = math.log((1 - eps) / eps)  # sigmoid(target) = 1 - eps
    assert loss("exo_pair", target, 0.0, beta=1.0, label_smoothing=eps) == pytest.approx(0.0, abs=1e-9)
    assert loss("exo_pair", target + dz, 0.0, beta=1.0, label_smoothing=eps) >= -1e-12


def test_sppo_hard_pulls_each_log_ratio_to_its_target() -> None:
    beta = 0.25
    r_w, r_l = torch.tensor([0.3], requires_grad=True), torch.tensor([0.1], requires_grad=True)
    preference_loss(r_w, r_l, loss_type="sppo_hard", beta=beta).sum().backward()
    assert float(r_w.grad) == pytest.approx(2 * (0.3 - 2.0)) and float(r_l.grad) == pytest.approx(2 * (0.1 + 2.0))
    assert loss("sppo_hard", 2.0, -2.0, beta=beta) == 0.0


@pytest.mark.parametrize("loss_type", ["robust", "exo_pair"])
def test_the_noise_losses_need_label_smoothing(loss_type: str) -> None:
    with pytest.raises(ValueError, match=rf"the {loss_type} loss needs label_smoothing in \(0, 0.5\)"):
        loss(loss_type, beta=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_discopop_stays_finite_far_from_the_reference(dtype: torch.dtype) -> None:
    """exp(-z) overflows at z ~ -89 (float32) or -710 (float64); the loss and its gradient stay
    finite, near the logistic loss's -z where the modulation vanishes."""
    r_w = torch.tensor([-2000.0, -100.0, 0.0, 100.0], dtype=dtype, requires_grad=True)
    out = preference_loss(r_w, torch.zeros_like(r_w), loss_type="discopop", beta=1.0, discopop_tau=0.05)
    out.sum().backward()
    out = out.detach()
    assert torch.isfinite(out).all() and torch.isfinite(r_w.grad).all()
    assert float(out[0]) == pytest.approx(2000.0) and float(out[1]) == pytest.approx(100.0)
    assert float(out[2]) == pytest.approx(0.5 * math.log(2) + 0.5)
