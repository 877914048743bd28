"""Policy loss ``ppo_clip`` against hand-computed values."""

from __future__ import annotations

import math

import core_rl_grpo.plugin as grpo_plugin
import pytest
import torch
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import POLICY_LOSS
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch
from core_rl_grpo.config import PPOClipConfig
from core_rl_grpo.losses import PPOClipLoss, policy_ratio, ppo_clip_loss

LN2 = math.log(2.0)


def make_loss(**options: object) -> PPOClipLoss:
    host = PluginHost(entry_points=[])
    host.register_plugin(grpo_plugin, distribution="core-rl-grpo")
    entry = host.get(POLICY_LOSS, "ppo_clip")
    loss = entry.factory(structure(options, entry.config_cls, path="algorithm.loss"))
    assert isinstance(loss, PPOClipLoss)
    return loss


def row_batch(
    ratios: list[float], advantages: list[float], *, old: float = -1.0, mask: list[float] | None = None
) -> tuple[TensorBatch, torch.Tensor]:
    """One sequence whose tokens have the given ratios; returns the batch and the current log-probs."""
    n = len(ratios)
    m = torch.tensor([mask if mask is not None else [1.0] * n])
    old_lp = torch.full((1, n), old) * m
    lp = (old_lp + torch.log(torch.tensor([ratios])) * m).requires_grad_(True)
    batch = TensorBatch({"response_mask": m, "old_logprobs": old_lp, "advantages": torch.tensor([advantages]) * m})
    return batch, lp


def forward(loss: PPOClipLoss, batch: TensorBatch, lp: torch.Tensor, entropy: torch.Tensor | None = None):
    ent = entropy if entropy is not None else torch.zeros_like(lp)
    out = loss(batch, lp, ent)
    weights = loss.loss_weights(batch["response_mask"])
    (out.per_token_loss * weights).sum().backward()
    return out, weights


def close(got: torch.Tensor, want: list[float] | list[list[float]]) -> None:
    torch.testing.assert_close(got.detach(), torch.tensor(want), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- aggregation

# 2 x 3 example: sequence 0 has 2 response tokens, sequence 1 has 3. On-policy (ratio 1) the
# per-token loss is -A, so A = -l gives per-token losses l = [[1, 2, (9 masked)], [3, 4, 5]].
AGG_MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
AGG_ADV = [[-1.0, -2.0, -9.0], [-3.0, -4.0, -5.0]]


@pytest.mark.parametrize(
    ("options", "weights", "total"),
    [
        # all 5 tokens: w = 1/5; (1+2+3+4+5)/5 = 3
        ({"aggregation": "token-mean"}, [[0.2, 0.2, 0], [0.2, 0.2, 0.2]], 3.0),
        # w = 1/(N L_i): 1/(2*2), 1/(2*3); ((1+2)/2 + (3+4+5)/3) / 2 = (1.5 + 4) / 2 = 2.75
        ({"aggregation": "seq-mean-token-mean"}, [[1 / 4, 1 / 4, 0], [1 / 6, 1 / 6, 1 / 6]], 2.75),
        # w = 1/N = 1/2; (3 + 12) / 2 = 7.5
        ({"aggregation": "seq-mean-token-sum"}, [[0.5, 0.5, 0], [0.5, 0.5, 0.5]], 7.5),
        # w = 1/(N C), C = 4: 1/8; 15 / 8 = 1.875
        ({"aggregation": "seq-mean-token-sum-norm", "norm_length": 4}, [[1 / 8, 1 / 8, 0], [1 / 8] * 3], 1.875),
    ],
)
def test_aggregation_modes(options: dict[str, object], weights: list[list[float]], total: float) -> None:
    loss = make_loss(**options)
    mask = torch.tensor(AGG_MASK)
    old = -0.5 * mask
    batch = TensorBatch({"response_mask": mask, "old_logprobs": old, "advantages": torch.tensor(AGG_ADV)})
    out = loss(batch, old.clone(), torch.zeros(2, 3))
    close(out.per_token_loss, [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])
    close(loss.loss_weights(mask), weights)
    assert (out.per_token_loss * loss.loss_weights(mask)).sum().item() == pytest.approx(total)


# --------------------------------------------------------------------------- clipping


def test_clip_both_sides() -> None:
    # eps 0.2, range [0.8, 1.2]; per token: max(-A r, -A clip(r))
    #   r 1.5, A  1: max(-1.5, -1.2) = -1.2   clipped (upper)
    #   r 0.5, A  1: max(-0.5, -0.8) = -0.5   (lower bound does not bind a positive advantage)
    #   r 0.5, A -1: max( 0.5,  0.8) =  0.8   clipped (lower)
    #   r 1.5, A -1: max( 1.5,  1.2) =  1.5   (upper bound does not bind a negative advantage)
    #   r 1.1, A  2: max(-2.2, -2.2) = -2.2   inside the range
    loss = make_loss(eps_clip=0.2)
    batch, lp = row_batch([1.5, 0.5, 0.5, 1.5, 1.1], [1.0, 1.0, -1.0, -1.0, 2.0])
    out, _ = forward(loss, batch, lp)
    close(out.per_token_loss, [[-1.2, -0.5, 0.8, 1.5, -2.2]])
    close(out.token_metrics["clipped"], [[1.0, 0.0, 1.0, 0.0, 0.0]])
    close(out.token_metrics["ratio"], [[1.5, 0.5, 0.5, 1.5, 1.1]])
    # d(-A r)/d lp = -A r where unclipped, 0 where clipped; token-mean weight 1/5
    close(lp.grad, [[0.0, -0.5 / 5, 0.0, 1.5 / 5, -2.2 / 5]])


def test_eps_clip_higher_is_asymmetric() -> None:
    #   r 1.5,  A  1: upper 1.28 -> -1.28 clipped       (symmetric 0.2: -1.2)
    #   r 1.25, A  1: inside [0.8, 1.28] -> -1.25       (symmetric 0.2: -1.2, clipped)
    #   r 0.5,  A -1: lower still 0.8 -> 0.8 clipped
    #   r 0.75, A -1: lower 0.8 -> 0.8 clipped
    ratios, adv = [1.5, 1.25, 0.5, 0.75], [1.0, 1.0, -1.0, -1.0]
    asym, _ = forward(make_loss(eps_clip=0.2, eps_clip_higher=0.28), *row_batch(ratios, adv))
    close(asym.per_token_loss, [[-1.28, -1.25, 0.8, 0.8]])
    close(asym.token_metrics["clipped"], [[1.0, 0.0, 1.0, 1.0]])
    sym, _ = forward(make_loss(eps_clip=0.2), *row_batch(ratios, adv))
    close(sym.per_token_loss, [[-1.2, -1.2, 0.8, 0.8]])
    close(sym.token_metrics["clipped"], [[1.0, 1.0, 1.0, 1.0]])


def test_dual_clip() -> None:
    # c = 3; for A < 0: min(max(-A r, -A clip(r)), -c A)
    #   r 5,   A -1: max(5, 1.2) = 5 -> min(5, 3) = 3        dual-clipped
    #   r 2,   A -1: max(2, 1.2) = 2 -> min(2, 3) = 2
    #   r 5,   A  1: max(-5, -1.2) = -1.2 (A > 0: no dual clip)  clipped
    #   r 4,   A -2: max(8, 2.4) = 8 -> min(8, 6) = 6        dual-clipped
    #   r 0.5, A -1: max(0.5, 0.8) = 0.8 -> min(0.8, 3) = 0.8  clipped
    ratios, adv = [5.0, 2.0, 5.0, 4.0, 0.5], [-1.0, -1.0, 1.0, -2.0, -1.0]
    batch, lp = row_batch(ratios, adv)
    out, _ = forward(make_loss(c_clip=3.0), batch, lp)
    close(out.per_token_loss, [[3.0, 2.0, -1.2, 6.0, 0.8]])
    close(out.token_metrics["dual_clipped"], [[1.0, 0.0, 0.0, 1.0, 0.0]])
    close(out.token_metrics["clipped"], [[0.0, 0.0, 1.0, 0.0, 1.0]])
    # only token 1 has a gradient: -A r = 2, weight 1/5
    close(lp.grad, [[0.0, 2.0 / 5, 0.0, 0.0, 0.0]])
    plain, _ = forward(make_loss(), *row_batch(ratios, adv))
    close(plain.per_token_loss, [[5.0, 2.0, -1.2, 8.0, 0.8]])
    assert "dual_clipped" not in plain.token_metrics


# --------------------------------------------------------------------------- KL, entropy, diagnostics

# d = logprobs - ref = [1, -1, 0]
#   k1 = d                = [1, -1, 0]
#   k2 = d^2 / 2          = [0.5, 0.5, 0]
#   k3 = exp(-d) - 1 + d  = [e^-1 = 0.36787944, e - 2 = 0.71828183, 0]
# d/d logprobs: k1 -> 1; k2 -> d; k3 -> 1 - exp(-d) = [0.63212056, -1.71828183, 0]
KL_CASES = [
    ("k1", [1.0, -1.0, 0.0], [1.0, 1.0, 1.0]),
    ("k2", [0.5, 0.5, 0.0], [1.0, -1.0, 0.0]),
    ("k3", [0.36787944, 0.71828183, 0.0], [0.63212056, -1.71828183, 0.0]),
]


@pytest.mark.parametrize(("estimator", "kl", "dkl"), KL_CASES)
def test_kl_penalty(estimator: str, kl: list[float], dkl: list[float]) -> None:
    loss = make_loss(kl_coef=0.1, kl_estimator=estimator)
    assert loss.requires_reference
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    batch = TensorBatch(
        {
            "response_mask": torch.ones(1, 3),
            "old_logprobs": lp.clone(),
            "ref_logprobs": torch.tensor([[-2.0, -1.0, -0.5]]),
            "advantages": torch.zeros(1, 3),
        }
    )
    lp.requires_grad_(True)
    out, _ = forward(loss, batch, lp)
    close(out.per_token_loss, [[0.1 * k for k in kl]])
    close(out.token_metrics["kl"], [kl])
    close(lp.grad, [[0.1 * g / 3 for g in dkl]])  # token-mean weight 1/3


def test_no_kl_needs_no_reference() -> None:
    loss = make_loss()
    assert not loss.requires_reference
    batch, lp = row_batch([1.0, 1.0], [1.0, -1.0])
    out = loss(batch, lp, torch.zeros_like(lp))
    assert "kl" not in out.token_metrics
    with pytest.raises(KeyError, match="ref_logprobs"):
        make_loss(kl_coef=0.1)(batch, lp, torch.zeros_like(lp))


def test_entropy_bonus() -> None:
    # A = 0, on-policy: loss = -0.01 * H on response tokens, 0 on the masked one
    batch, lp = row_batch([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], mask=[1.0, 1.0, 0.0])
    entropy = torch.tensor([[2.0, 1.0, 5.0]], requires_grad=True)
    out, _ = forward(make_loss(entropy_coef=0.01), batch, lp, entropy)
    close(out.per_token_loss, [[-0.02, -0.01, 0.0]])
    close(entropy.grad, [[-0.01 / 2, -0.01 / 2, 0.0]])


def test_approx_kl_is_k3_of_old_vs_current() -> None:
    # KL(pi_old || pi) per token with rho = pi / pi_old: rho - 1 - log rho
    #   rho 2:   1 - ln 2 = 0.30685282;   rho 0.5: -0.5 + ln 2 = 0.19314718;   rho 1: 0
    out, _ = forward(make_loss(), *row_batch([2.0, 0.5, 1.0], [1.0, 1.0, 1.0]))
    close(out.token_metrics["approx_kl"], [[1 - LN2, LN2 - 0.5, 0.0]])


def test_metrics_vanish_off_response() -> None:
    loss = make_loss(kl_coef=0.1, c_clip=2.0)
    batch = make_rl_batch(seed=4)
    lp = batch["old_logprobs"] + 0.5 * batch["response_mask"]
    out = loss(batch, lp, torch.ones_like(lp))
    off = batch["response_mask"] == 0
    assert set(out.token_metrics) == {"ratio", "ratio_max", "clipped", "dual_clipped", "approx_kl", "kl"}
    for value in [out.per_token_loss, *out.token_metrics.values()]:
        assert value.shape == lp.shape and (value[off] == 0).all()


def test_extreme_log_ratio_stays_finite() -> None:
    batch, _ = row_batch([1.0, 1.0], [-1.0, 1.0])
    lp = (batch["old_logprobs"] + torch.tensor([[80.0, -80.0]])).requires_grad_(True)
    batch["ref_logprobs"] = batch["old_logprobs"].clone()
    out, _ = forward(make_loss(kl_coef=0.1, kl_estimator="k3"), batch, lp)
    assert torch.isfinite(out.per_token_loss).all() and torch.isfinite(lp.grad).all()
    assert policy_ratio(torch.tensor([100.0]), torch.tensor([0.0])).item() == pytest.approx(math.exp(20.0))


# --------------------------------------------------------------------------- invariants and parity


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_on_policy_gradient_is_minus_advantage_times_weight(aggregation: str) -> None:
    # at ratio 1 no clip binds and d(-A r)/d lp = -A r = -A
    loss = make_loss(aggregation=aggregation, norm_length=8, eps_clip_higher=0.3, c_clip=3.0)
    batch = make_rl_batch(seed=2)
    batch["loss_weight"] = loss.loss_weights(batch["response_mask"])
    lp = batch["old_logprobs"].clone().requires_grad_(True)
    out = loss(batch, lp, torch.zeros_like(lp))
    (out.per_token_loss * batch["loss_weight"]).sum().backward()
    torch.testing.assert_close(lp.grad, -batch["advantages"] * batch["loss_weight"])
    assert (out.token_metrics["clipped"] == 0).all()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"aggregation": "seq-mean-token-mean", "c_clip": 2.0},
        {"aggregation": "seq-mean-token-sum", "kl_coef": 0.2, "kl_estimator": "k1", "entropy_coef": 0.05},
        {"aggregation": "seq-mean-token-sum-norm", "norm_length": 16, "eps_clip_higher": 0.28, "kl_coef": 0.1},
    ],
)
def test_micro_batch_split_gives_same_loss_and_gradient(options: dict[str, object]) -> None:
    loss = make_loss(**options)
    batch = make_rl_batch(batch_size=7, seed=6)
    batch["loss_weight"] = loss.loss_weights(batch["response_mask"])
    noise = torch.randn(batch["old_logprobs"].shape, generator=torch.Generator().manual_seed(1)) * 0.4
    base = (batch["old_logprobs"] + noise) * batch["response_mask"]
    entropy = torch.rand(base.shape, generator=torch.Generator().manual_seed(2))

    whole = base.clone().requires_grad_(True)
    full = (loss(batch, whole, entropy).per_token_loss * batch["loss_weight"]).sum()
    full.backward()

    split = base.clone().requires_grad_(True)
    total = torch.zeros(())
    for rows in (slice(0, 1), slice(1, 4), slice(4, 7)):
        mb = batch.rows(rows)
        part = (loss(mb, split[rows], entropy[rows]).per_token_loss * mb["loss_weight"]).sum()
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(split.grad, whole.grad)


def _scalar_token_loss(lp: float, old: float, ref: float, a: float, h: float, cfg: PPOClipConfig) -> float:
    """The per-token loss written out with scalar math, branch by branch."""
    r = math.exp(lp - old)
    high = cfg.eps_clip_higher if cfg.eps_clip_higher is not None else cfg.eps_clip
    r_clip = min(max(r, 1 - cfg.eps_clip), 1 + high)
    value = max(-a * r, -a * r_clip)
    if cfg.c_clip is not None and a < 0:
        value = min(value, -cfg.c_clip * a)
    if cfg.kl_coef > 0:
        d = lp - ref
        kl = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[cfg.kl_estimator]
        value += cfg.kl_coef * min(max(kl, -10.0), 10.0)  # estimates are capped at +-10
    return value - cfg.entropy_coef * h


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"eps_clip": 0.1, "eps_clip_higher": 0.3, "c_clip": 2.5},
        {"kl_coef": 0.3, "kl_estimator": "k3", "entropy_coef": 0.02},
        {"kl_coef": 0.3, "kl_estimator": "k2", "aggregation": "seq-mean-token-mean"},
    ],
)
def test_parity_with_scalar_loop(options: dict[str, object]) -> None:
    loss = make_loss(**options)
    cfg = loss.config
    batch = make_rl_batch(batch_size=6, seed=9)
    noise = torch.randn(batch["old_logprobs"].shape, generator=torch.Generator().manual_seed(3)) * 0.5
    lp = (batch["old_logprobs"] + noise) * batch["response_mask"]
    entropy = torch.rand(lp.shape, generator=torch.Generator().manual_seed(4))
    got = loss(batch, lp, entropy).per_token_loss
    weights = loss.loss_weights(batch["response_mask"])
    want = torch.zeros_like(lp)
    want_total = 0.0
    rows, width = lp.shape
    for i in range(rows):
        tokens = [t for t in range(width) if batch["response_mask"][i, t] > 0]
        seq = [
            _scalar_token_loss(
                float(lp[i, t]),
                float(batch["old_logprobs"][i, t]),
                float(batch["ref_logprobs"][i, t]),
                float(batch["advantages"][i, t]),
                float(entropy[i, t]),
                cfg,
            )
            for t in tokens
        ]
        for t, v in zip(tokens, seq):
            want[i, t] = v
        if cfg.aggregation == "seq-mean-token-mean":
            want_total += sum(seq) / len(seq) / rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if cfg.aggregation == "token-mean":
        want_total = float(want.sum()) / float(batch["response_mask"].sum())
    assert float((got * weights).sum()) == pytest.approx(want_total, rel=1e-5)


def test_ppo_clip_loss_function_directly() -> None:
    # the pure function, no masking: r 1.3, A 1 -> -1.2 clipped; r 0.9, A -1 -> 0.9
    loss, clipped, dual = ppo_clip_loss(torch.tensor([1.3, 0.9]), torch.tensor([1.0, -1.0]), eps_low=0.2, eps_high=0.2)
    close(loss, [-1.2, 0.9])
    assert clipped.tolist() == [True, False] and dual.tolist() == [False, False]


# --------------------------------------------------------------------------- configuration


def test_config_defaults() -> None:
    cfg = structure({}, PPOClipConfig)
    assert cfg == PPOClipConfig(
        eps_clip=0.2,
        eps_clip_higher=None,
        c_clip=None,
        importance_sampling_level="token",
        aggregation="token-mean",
        norm_length=None,
        kl_coef=0.0,
        kl_estimator="k3",
        entropy_coef=0.0,
        use_decoupled_loss=False,
        prox_logp_method="recompute",
        off_policy_mask_threshold=None,
        use_sapo_loss=False,
        sapo_tau_pos=1.0,
        sapo_tau_neg=1.05,
        m2_threshold=None,
        use_cispo_loss=False,
        cispo_eps_low=1.0,
        cispo_eps_high=0.28,
    )


def test_cispo_keeps_the_gradient_ppo_clips_and_agrees_on_policy() -> None:
    """On-policy (ratio 1) CISPO's gradient is PPO's; off-policy a token whose ratio left PPO's range
    in the advantage's favour gets no gradient from PPO and the clipped weight's from CISPO."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5]])
    mask = torch.ones_like(old)
    batch = TensorBatch(
        {"response_mask": mask, "old_logprobs": old, "advantages": torch.tensor([[1.0, -1.0, 2.0, 0.5]])}
    )
    grads = {}
    for name, options in {"ppo": {}, "cispo": {"use_cispo_loss": True, "cispo_eps_high": 0.28}}.items():
        loss = PPOClipLoss(structure(options, PPOClipConfig))
        for shift in (0.0, 0.4):  # ratio 1, then exp(0.4) = 1.49 on every token
            lp = (old + shift).requires_grad_(True)
            loss(batch, lp, torch.zeros_like(lp)).per_token_loss.sum().backward()
            grads[name, shift] = lp.grad
    torch.testing.assert_close(grads["cispo", 0.0], grads["ppo", 0.0])
    # ratio 1.49: PPO clips the positive advantages (gradient 0) and keeps -A rho for the negative one;
    # CISPO's gradient with respect to log pi is -A w everywhere, w = min(1.49, 1 + 0.28) = 1.28
    assert grads["ppo", 0.4][0, [0, 2, 3]].abs().max() == 0
    torch.testing.assert_close(grads["cispo", 0.4], torch.tensor([[-1.28, 1.28, -2.56, -0.64]]))


def test_cispo_cannot_combine_with_another_surrogate() -> None:
    for options in ({"use_sapo_loss": True}, {"c_clip": 3.0}, {"eps_clip_higher": 0.3}):
        with pytest.raises(ConfigError, match=r"cannot be combined with use_cispo_loss: true"):
            structure({"use_cispo_loss": True, **options}, PPOClipConfig, path="algorithm.loss")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"eps_clip": 0.0}, r"algorithm\.loss\.eps_clip: must be in \(0\.0, 1\.0\]"),
        ({"eps_clip_higher": -0.1}, r"algorithm\.loss\.eps_clip_higher: must be > 0"),
        ({"c_clip": 1.0}, r"algorithm\.loss\.c_clip: must be > 1"),
        ({"aggregation": "mean"}, r"algorithm\.loss\.aggregation: must be one of 'token-mean'"),
        (
            {"norm_length": 0, "aggregation": "seq-mean-token-sum-norm"},
            r"algorithm\.loss\.norm_length: must be in \[1, 16777216\]",
        ),
        ({"kl_coef": -0.1}, r"algorithm\.loss\.kl_coef: must be >= 0"),
        ({"kl_estimator": "k4"}, r"algorithm\.loss\.kl_estimator: must be one of 'k1', 'k2', 'k3'"),
        ({"entropy_coef": -1}, r"algorithm\.loss\.entropy_coef: must be >= 0"),
        ({"eps_clip": "wide"}, r"algorithm\.loss\.eps_clip: expected a number"),
        ({"eps_clipp": 0.3}, r"algorithm\.loss\.eps_clipp: unknown key; did you mean 'eps_clip'"),
    ],
)
def test_config_errors_name_the_key(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        structure(options, PPOClipConfig, path="algorithm.loss")


def test_the_entropy_needs_a_gradient_only_with_an_entropy_bonus() -> None:
    """``entropy_grad`` tells engines whether to keep the entropy's graph: only with
    ``entropy_coef > 0`` does the loss differentiate through it."""
    assert make_loss().entropy_grad is False
    assert make_loss(entropy_coef=0.01).entropy_grad is True
