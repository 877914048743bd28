"""The value-function math of core_rl.ops: GAE, token rewards, clipped value loss, the adaptive KL
controller and the distillation loss, against hand-computed values and an independent
formulation of GAE (the defining sum, in plain Python)."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl import ops
from hypothesis import given, settings
from hypothesis import strategies as st


def _gae_by_definition(
    rewards: list[float], values: list[float], mask: list[int], discount: float, lam: float
) -> list[float]:
    """A_t = sum_k (discount * lam)^k delta_{t+k} over the masked tokens only (compacted), with
    delta_t = r_t + discount * V_{t+1} - V_t and V = 0 after the last token; 0 off the mask."""
    on = [i for i, m in enumerate(mask) if m]
    r = [rewards[i] for i in on]
    v = [values[i] for i in on] + [0.0]
    delta = [r[k] + discount * v[k + 1] - v[k] for k in range(len(on))]
    out = [0.0] * len(mask)
    for k, i in enumerate(on):
        out[i] = sum((discount * lam) ** j * delta[k + j] for j in range(len(on) - k))
    return out


def test_gae_hand_computed() -> None:
    # one row: prompt token (masked out), three response tokens, one pad
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    adv, ret = ops.gae_advantages(rewards, values, mask, discount=0.9, gae_lambda=0.8)
    d3 = 1.0 + 0.0 - 0.7  # 0.3
    d2 = 0.0 + 0.9 * 0.7 - 0.6  # 0.03
    d1 = 0.0 + 0.9 * 0.6 - 0.5  # 0.04
    a3 = d3
    a2 = d2 + 0.72 * a3
    a1 = d1 + 0.72 * a2
    torch.testing.assert_close(adv, torch.tensor([[0.0, a1, a2, a3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, a1 + 0.5, a2 + 0.6, a3 + 0.7, 0.0]]))


def test_gae_lambda_limits() -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]])
    m = mask.float()
    gamma = 0.95
    # lambda = 0: one-step TD errors
    adv0, _ = ops.gae_advantages(rewards, values, mask, discount=gamma, gae_lambda=0.0)
    for b in range(3):
        on = [i for i in range(7) if mask[b, i]]
        for k, i in enumerate(on):
            nxt = values[b, on[k + 1]] if k + 1 < len(on) else 0.0
            assert math.isclose(float(adv0[b, i]), float(rewards[b, i] + gamma * nxt - values[b, i]), abs_tol=1e-5)
    # lambda = 1: discounted returns minus the value; the value target is the discounted return
    adv1, ret1 = ops.gae_advantages(rewards, values, mask, discount=gamma, gae_lambda=1.0)
    for b in range(3):
        on = [i for i in range(7) if mask[b, i]]
        for k, i in enumerate(on):
            g_t = sum(gamma**j * float(rewards[b, on[k + j]]) for j in range(len(on) - k))
            assert math.isclose(float(ret1[b, i]), g_t, abs_tol=1e-5)
            assert math.isclose(float(adv1[b, i]), g_t - float(values[b, i]), abs_tol=1e-5)
    assert torch.equal(adv1 * (1 - m), torch.zeros_like(adv1))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 9),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.integers(0, 10_000),
)
def test_gae_matches_the_defining_sum(rows: int, width: int, discount: float, lam: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, width, generator=g, dtype=torch.float64)
    values = torch.randn(rows, width, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, width, generator=g) < 0.7).long()  # holes allowed
    adv, ret = ops.gae_advantages(rewards, values, mask, discount=discount, gae_lambda=lam)
    for b in range(rows):
        want = _gae_by_definition(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), discount, lam)
        torch.testing.assert_close(adv[b].double(), torch.tensor(want, dtype=torch.float64), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret, (adv + values.float()) * mask.float())


def test_token_level_rewards() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
    kl = torch.tensor([[5.0, 0.1, 0.2, 5.0], [5.0, 5.0, 0.3, -0.4], [1.0, 1.0, 1.0, 1.0]])
    r = ops.token_level_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl=kl, kl_coef=0.5)
    want = torch.tensor([[0.0, -0.05, 1.0 - 0.1, 0.0], [0.0, 0.0, -0.15, 2.0 + 0.2], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(r, want)


def test_value_loss_hand_computed() -> None:
    v = torch.tensor([1.0, 2.0, -1.0, 0.0])
    old = torch.tensor([0.0, 2.5, 0.0, 0.0])
    ret = torch.tensor([2.0, 0.0, -3.0, 0.1])
    # mse, no clip: 0.5 * (v - R)^2
    loss, clipped = ops.value_loss(v, old, ret, eps_clip=None)
    torch.testing.assert_close(loss, torch.tensor([0.5, 2.0, 2.0, 0.005]))
    assert not clipped.any()
    # mse, clip 0.2: v_clip = [0.2, 2.3, -0.2, 0.0]
    loss, clipped = ops.value_loss(v, old, ret, eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([0.5 * 1.8**2, 0.5 * 2.3**2, 0.5 * 2.8**2, 0.005]))
    assert clipped.tolist() == [True, True, True, False]
    # huber (delta 1): |e| <= 1 -> 0.5 e^2, else |e| - 0.5
    loss, _ = ops.value_loss(v, old, ret, eps_clip=None, loss="huber", huber_delta=1.0)
    torch.testing.assert_close(loss, torch.tensor([0.5, 1.5, 1.5, 0.005]))
    loss, _ = ops.value_loss(v, old, ret, eps_clip=0.2, loss="huber", huber_delta=1.0)
    torch.testing.assert_close(loss, torch.tensor([1.3, 1.8, 2.3, 0.005]))
    with pytest.raises(ValueError, match="unknown value loss"):
        ops.value_loss(v, old, ret, eps_clip=None, loss="l1")


def test_clipped_value_loss_has_no_gradient_where_clipped() -> None:
    v = torch.tensor([1.0, 0.1], requires_grad=True)
    loss, clipped = ops.value_loss(v, torch.zeros(2), torch.tensor([2.0, 1.0]), eps_clip=0.2)
    loss.sum().backward()
    assert clipped.tolist() == [True, False]
    torch.testing.assert_close(v.grad, torch.tensor([0.0, 0.1 - 1.0]))


def test_adaptive_kl_coef() -> None:
    # KL above target: error clipped at 0.2 -> coef * (1 + 0.2 * 64 / 1000)
    assert math.isclose(ops.adaptive_kl_coef(0.1, 1.0, target=0.1, horizon=1000, n_steps=64), 0.1 * 1.0128)
    # KL at half the target: error -0.5 clipped to -0.2
    assert math.isclose(ops.adaptive_kl_coef(0.1, 0.05, target=0.1, horizon=1000, n_steps=64), 0.1 * 0.9872)
    # within the band: error 0.1
    assert math.isclose(ops.adaptive_kl_coef(0.2, 0.11, target=0.1, horizon=100, n_steps=10), 0.2 * 1.01)
    assert ops.adaptive_kl_coef(0.2, 0.1, target=0.1, horizon=100, n_steps=10) == 0.2


def test_reverse_kl_distill_loss_value_and_gradient() -> None:
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    teacher = torch.tensor([-1.5, -1.0])
    loss = ops.reverse_kl_distill_loss(lp, teacher)
    torch.testing.assert_close(loss.detach(), torch.tensor([0.5 * -1.0, -1.0 * -2.0]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.5, -1.0]))  # = log pi - log teacher
    lp.grad = None
    ops.reverse_kl_distill_loss(lp, teacher, torch.tensor([0.25, -0.5])).sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.25, -0.5]))  # = log pi - log teacher - baseline
