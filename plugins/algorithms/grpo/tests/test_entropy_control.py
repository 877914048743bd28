"""``ppo_clip``'s options against entropy collapse: ``loss_mode: clip_cov | kl_cov`` (covariance
token selection), ``top_entropy_quantile`` (the policy gradient on high-entropy tokens only) and
``adv_clip_low``/``adv_clip_high`` (advantage clipping).
Hand values of the selections and losses, their gradients, the invariants (ratio 0, coefficient 0
and quantile 1 turn them off), parity with the reference formulation, determinism (the same step
draws the same tokens, on every rank and after a resume), configuration errors, and a real run."""

from __future__ import annotations

import math

import pytest
import torch
from core_rl import ops
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.protocol import TensorBatch
from core_rl.testing import make_rl_batch, reference
from core_rl_grpo.config import PPOClipConfig
from core_rl_grpo.covariance import step_generator
from core_rl_grpo.losses import PPOClipLoss
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=25, deadline=None)


def make_loss(**options: object) -> PPOClipLoss:
    """``ppo_clip`` from YAML-like options, validated as the ``algorithm.loss`` section."""
    return PPOClipLoss(structure(options, PPOClipConfig, path="algorithm.loss"))


def weighted(loss: PPOClipLoss, batch: TensorBatch, lp: torch.Tensor, entropy: torch.Tensor | None = None):
    """(aggregated loss, d loss / d lp, token metrics), after ``prepare`` as the trainer runs it."""
    loss.prepare(batch)
    lp = lp.detach().clone().requires_grad_(True)
    out = loss(batch, lp, entropy if entropy is not None else torch.zeros_like(lp))
    total = (out.per_token_loss * loss.loss_weights(batch["loss_mask"])).sum()
    total.backward()
    return total.detach(), lp.grad, out.token_metrics


def drifted(batch: TensorBatch, seed: int, scale: float = 0.3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (batch["old_logprobs"] + scale * torch.randn(batch["old_logprobs"].shape, generator=g)) * batch[
        "response_mask"
    ]


# --------------------------------------------------------------------------- hand values


def test_token_covariance_and_selections_by_hand() -> None:
    # 4 tokens (one padded): A = [2, 2, -1 | pad], lp = [-1, -3, -2 | pad]
    # mean A = 1, mean lp = -2; cov = (1)(1), (1)(-1), (-2)(0) = [1, -1, 0]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[2.0, 2.0], [-1.0, 0.0]])
    lp = torch.tensor([[-1.0, -3.0], [-2.0, 0.0]])
    cov = ops.token_covariance(lp, adv, mask)
    torch.testing.assert_close(cov, torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    # KL-Cov: k = max(1, floor(0.5 * 3)) = 1 token, the largest covariance
    assert ops.kl_cov_select(cov, mask, ratio=0.5).tolist() == [[True, False], [False, False]]
    assert ops.kl_cov_select(cov, mask, ratio=0.7).tolist() == [[True, False], [True, False]]  # k = 2
    assert not ops.kl_cov_select(cov, mask, ratio=0.0).any()
    # Clip-Cov: candidates strictly inside (low, high): (-0.5, 2) leaves tokens 0 and 2 (cov 1, 0)
    g = torch.Generator().manual_seed(0)
    both = ops.clip_cov_select(cov, mask, ratio=1.0, low=-0.5, high=2.0, generator=g)
    assert both.tolist() == [[True, False], [True, False]]
    one = ops.clip_cov_select(cov, mask, ratio=0.5, low=-0.5, high=2.0, generator=g)
    assert int(one.sum()) == 1 and not (one & ~both).any()
    assert not ops.clip_cov_select(cov, mask, ratio=1.0, low=1.0, high=5.0, generator=g).any()  # 1 is not > 1
    assert [ops.selection_count(r, 10) for r in (0.0, 0.0002, 0.25, 1.0)] == [0, 1, 2, 10]


def test_clip_cov_loss_and_gradient_by_hand() -> None:
    # one row, A = +1 on 3 tokens, ratios [1, 1, 1.5]: token 2 is clipped (eps 0.2); cov by hand:
    # mean lp_old = -1, A constant so cov = 0 everywhere -> a band (-1, 1) holding every token
    old = torch.full((1, 3), -1.0)
    batch = TensorBatch(
        {
            "response_mask": torch.ones(1, 3),
            "loss_mask": torch.ones(1, 3),
            "old_logprobs": old,
            "advantages": torch.ones(1, 3),
            "train_version": torch.tensor([1]),
        }
    )
    lp = old + torch.log(torch.tensor([[1.0, 1.0, 1.5]]))
    loss = make_loss(loss_mode="clip_cov", clip_cov_ratio=1.0, clip_cov_lb=-1.0, clip_cov_ub=1.0)
    total, grad, metrics = weighted(loss, batch, lp)
    # every token selected; tokens 0, 1 leave the loss, token 2 keeps its clipped loss -1.2
    assert batch["cov_selected"].tolist() == [[1.0, 1.0, 1.0]]
    assert metrics["cov_clipped"].tolist() == [[1.0, 1.0, 0.0]]
    assert float(total) == pytest.approx(-1.2 / 3)
    torch.testing.assert_close(grad, torch.zeros(1, 3))


def test_kl_cov_loss_and_gradient_by_hand() -> None:
    # two tokens, A = [1, -1] (one row each), ratios [2, 0.5], both selected (ratio 1), coef 0.5
    # l = -A rho + 0.5 |log rho| = [-2 + 0.5 ln2, 0.5 + 0.5 ln2]; token-mean over 2 tokens
    # d l / d lp = -A rho + 0.5 sign(log rho) = [-2 + 0.5, 0.5 - 0.5], times the weight 1/2
    ln2 = float(torch.log(torch.tensor(2.0)))
    old = torch.tensor([[-1.0], [-2.0]])
    batch = TensorBatch(
        {
            "response_mask": torch.ones(2, 1),
            "loss_mask": torch.ones(2, 1),
            "old_logprobs": old,
            "advantages": torch.tensor([[1.0], [-1.0]]),
            "train_version": torch.tensor([1, 1]),
        }
    )
    lp = old + torch.tensor([[ln2], [-ln2]])
    total, grad, metrics = weighted(make_loss(loss_mode="kl_cov", kl_cov_ratio=1.0, ppo_kl_coef=0.5), batch, lp)
    assert float(total) == pytest.approx(((-2 + 0.5 * ln2) + (0.5 + 0.5 * ln2)) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-1.5 / 2], [0.0]]))
    assert metrics["cov_penalised"].tolist() == [[1.0], [1.0]]
    # (the surrogate is unclipped: token 0, ratio 2 with A > 0, keeps its -A rho gradient, which
    # PPO's clip would zero)


# --------------------------------------------------------------------------- invariants


@SETTINGS
@given(st.integers(0, 2**16), st.sampled_from(["token-mean", "seq-mean-token-mean"]), st.booleans())
def test_off_settings_are_the_plain_losses(seed, aggregation, decoupled) -> None:
    batch = make_rl_batch(seed=seed % 997)
    lp = drifted(batch, seed)
    base = {"aggregation": aggregation, "use_decoupled_loss": decoupled}
    plain = weighted(make_loss(**base, c_clip=3.0), batch, lp)
    # clip_cov with ratio 0 selects nothing: bitwise the plain clipped loss
    clip_off = weighted(make_loss(**base, c_clip=3.0, loss_mode="clip_cov", clip_cov_ratio=0.0), batch, lp)
    assert torch.equal(clip_off[0], plain[0]) and torch.equal(clip_off[1], plain[1])
    # kl_cov with coefficient 0 (or ratio 0) is the unclipped policy gradient: PPO with no clip
    unclipped = weighted(make_loss(**base, eps_clip=1.0, eps_clip_higher=1e9), batch, lp)
    for options in ({"ppo_kl_coef": 0.0, "kl_cov_ratio": 0.5}, {"kl_cov_ratio": 0.0}):
        kl_off = weighted(make_loss(**base, loss_mode="kl_cov", **options), batch, lp)
        torch.testing.assert_close(kl_off[0], unclipped[0], rtol=0, atol=0)
        torch.testing.assert_close(kl_off[1], unclipped[1], rtol=0, atol=0)


@SETTINGS
@given(st.integers(0, 2**16), st.floats(0.05, 1.0), st.floats(0.01, 2.0))
def test_kl_cov_adds_exactly_the_penalty_gradient_on_its_tokens(seed, ratio, coef) -> None:
    batch = make_rl_batch(seed=seed % 997)
    lp = drifted(batch, seed)
    off = weighted(make_loss(loss_mode="kl_cov", kl_cov_ratio=ratio, ppo_kl_coef=0.0), batch, lp)
    on = weighted(make_loss(loss_mode="kl_cov", kl_cov_ratio=ratio, ppo_kl_coef=coef), batch, lp)
    selected = batch["cov_selected"]
    weights = make_loss().loss_weights(batch["loss_mask"])
    # d/d lp of coef * w * |lp - old| on the selected tokens
    want = coef * weights * selected * torch.sign(lp - batch["old_logprobs"])
    torch.testing.assert_close(on[1] - off[1], want, rtol=1e-5, atol=1e-7)
    assert int(selected.sum()) == ops.selection_count(ratio, int(batch["loss_mask"].sum()))


@SETTINGS
@given(st.integers(0, 2**16), st.floats(0.0, 1.0), st.floats(-2.0, 0.5), st.floats(0.01, 3.0))
def test_selections_match_the_reference(seed, ratio, low, width) -> None:
    batch = make_rl_batch(seed=seed % 997, batch_size=5)
    g = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(batch["advantages"].shape, generator=g) * batch["response_mask"]
    mask = batch["loss_mask"]
    on = mask != 0
    rows = [(batch["old_logprobs"][i][on[i]].tolist(), batch["advantages"][i][on[i]].tolist()) for i in range(5)]
    ref_cov = reference.token_covariances([r[0] for r in rows], [r[1] for r in rows])
    cov = ops.token_covariance(batch["old_logprobs"], batch["advantages"], mask)
    for i in range(5):
        torch.testing.assert_close(cov[i][on[i]], torch.tensor(ref_cov[i]), rtol=1e-5, atol=1e-6)
    top = ops.kl_cov_select(cov, mask, ratio=ratio)
    assert [top[i][on[i]].tolist() for i in range(5)] == reference.kl_cov_selected(ref_cov, ratio)
    drawn = ops.clip_cov_select(cov, mask, ratio=ratio, low=low, high=low + width, generator=step_generator(seed))
    candidates = on & (cov > low) & (cov < low + width)
    assert not (drawn & ~candidates).any()
    assert int(drawn.sum()) == min(reference.cov_count(ratio, int(on.sum())), int(candidates.sum()))


def test_clip_cov_draw_is_seeded_by_the_step() -> None:
    """The same step draws the same tokens (every rank, a resumed run); another step, others."""
    batch = make_rl_batch(seed=3, batch_size=6, max_response_len=12)
    batch["advantages"] = torch.randn(batch["advantages"].shape, generator=torch.Generator().manual_seed(1))
    batch["advantages"] *= batch["response_mask"]
    loss = make_loss(loss_mode="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    draws = {}
    for step in (4, 4, 5, 6):
        batch["train_version"] = torch.full((6,), step)
        loss.prepare(batch)
        draws.setdefault(step, []).append(batch["cov_selected"].clone())
    assert torch.equal(draws[4][0], draws[4][1])
    assert not (torch.equal(draws[4][0], draws[5][0]) and torch.equal(draws[5][0], draws[6][0]))
    assert all(int(d[0].sum()) == ops.selection_count(0.2, int(batch["loss_mask"].sum())) for d in draws.values())


# --------------------------------------------------------------------------- top_entropy_quantile


def test_entropy_quantile_by_hand() -> None:
    # one row on-policy (l = -A), A = [1, 2, 3, 4], entropies [0.1, 0.5, 0.9, 0.3]; q = 0.5:
    # sorted [0.1, 0.3, 0.5, 0.9], position 0.5 * 3 = 1.5 -> tau = 0.3 + 0.5 * 0.2 = 0.4: tokens 1, 2 keep
    # token-mean over all 4 tokens: (-2 - 3) / 4; with kl_coef the KL term stays on every token
    old = torch.full((1, 4), -1.0)
    batch = TensorBatch(
        {
            "response_mask": torch.ones(1, 4),
            "loss_mask": torch.ones(1, 4),
            "old_logprobs": old,
            "ref_logprobs": old,
            "advantages": torch.tensor([[1.0, 2.0, 3.0, 4.0]]),
        }
    )
    entropy = torch.tensor([[0.1, 0.5, 0.9, 0.3]])
    total, grad, metrics = weighted(make_loss(top_entropy_quantile=0.5), batch, old, entropy)
    assert float(total) == pytest.approx(-5 / 4)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -2 / 4, -3 / 4, 0.0]]))
    assert metrics["entropy_kept"].tolist() == [[0.0, 1.0, 1.0, 0.0]]
    # k1 KL = lp - ref: gradient coef / 4 on every token, kept or not
    _, grad_kl, _ = weighted(make_loss(top_entropy_quantile=0.5, kl_coef=0.2, kl_estimator="k1"), batch, old, entropy)
    torch.testing.assert_close(grad_kl - grad, torch.full((1, 4), 0.2 / 4))


@SETTINGS
@given(st.integers(0, 2**16), st.floats(0.01, 1.0))
def test_entropy_quantile_threshold_and_kept_share(seed, q) -> None:
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) < 0.8).float()
    mask[0, 0] = 1.0
    kept = ops.top_quantile_mask(values, mask, q)
    population = values[mask != 0]
    tau = torch.quantile(population, 1 - q)
    assert torch.equal(kept, (mask != 0) & (values >= tau))
    n = population.numel()
    # distinct values: exactly the ones at or above position (1 - q)(n - 1), about q * n of them
    assert int(kept.sum()) == n - math.ceil((1 - q) * (n - 1) - 1e-9)
    assert abs(int(kept.sum()) - q * n) <= 1 + 1e-9


@SETTINGS
@given(st.integers(0, 2**16), st.floats(0.05, 0.95), st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_entropy_quantile_matches_the_reference_and_one_is_plain(seed, q, aggregation) -> None:
    batch = make_rl_batch(seed=seed % 997)
    lp = drifted(batch, seed)
    entropy = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed)) * batch["response_mask"]
    options = {"aggregation": aggregation, "kl_coef": 0.1, "top_entropy_quantile": q}
    total, grad, _ = weighted(make_loss(**options), batch, lp, entropy)
    on = batch["response_mask"] != 0
    ref_lp = lp.clone().requires_grad_(True)
    seqs = [
        {
            "logprobs": ref_lp[i][on[i]],
            "old": batch["old_logprobs"][i][on[i]],
            "behave": batch["behave_logprobs"][i][on[i]],
            "ref": batch["ref_logprobs"][i][on[i]],
            "adv": batch["advantages"][i][on[i]],
            "entropy": entropy[i][on[i]],
        }
        for i in range(batch.batch_size)
    ]
    want = reference.policy_loss(seqs, reference.spec_from_options(options))
    want.backward()
    torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_lp.grad, rtol=1e-5, atol=1e-6)
    plain = weighted(make_loss(kl_coef=0.1, aggregation=aggregation), batch, lp, entropy)
    one = weighted(make_loss(kl_coef=0.1, aggregation=aggregation, top_entropy_quantile=1.0), batch, lp, entropy)
    assert torch.equal(one[0], plain[0]) and torch.equal(one[1], plain[1]) and "entropy_kept" not in one[2]


# --------------------------------------------------------------------------- advantage clipping


def test_advantage_clipping_by_hand_and_off_is_plain() -> None:
    # on-policy (l = -A), A = [-3, 0.5, 4] clipped to [-1, 2]: l = [1, -0.5, -2], token-mean over 3
    old = torch.full((1, 3), -1.0)
    batch = TensorBatch(
        {
            "response_mask": torch.ones(1, 3),
            "loss_mask": torch.ones(1, 3),
            "old_logprobs": old,
            "advantages": torch.tensor([[-3.0, 0.5, 4.0]]),
        }
    )
    total, grad, _ = weighted(make_loss(adv_clip_low=-1.0, adv_clip_high=2.0), batch, old)
    assert float(total) == pytest.approx((1 - 0.5 - 2) / 3)
    torch.testing.assert_close(grad, torch.tensor([[1 / 3, -0.5 / 3, -2 / 3]]))
    only_high = weighted(make_loss(adv_clip_high=2.0), batch, old)
    assert float(only_high[0]) == pytest.approx((3 - 0.5 - 2) / 3)
    full = make_rl_batch(seed=2)
    lp = drifted(full, 2)
    plain = weighted(make_loss(kl_coef=0.1), full, lp)
    off = weighted(make_loss(kl_coef=0.1, adv_clip_low=None, adv_clip_high=None), full, lp)
    assert torch.equal(off[0], plain[0]) and torch.equal(off[1], plain[1])


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss_mode": "cov"}, r"algorithm\.loss\.loss_mode: must be one of"),
        ({"loss_mode": "clip_cov", "clip_cov_lb": 2.0, "clip_cov_ub": 1.0}, r"algorithm\.loss\.clip_cov_ub: must be >"),
        ({"loss_mode": "clip_cov", "use_sapo_loss": True}, r"algorithm\.loss\.use_sapo_loss: cannot be combined"),
        ({"loss_mode": "kl_cov", "use_cispo_loss": True}, r"algorithm\.loss\.use_cispo_loss: cannot be combined"),
        ({"loss_mode": "kl_cov", "c_clip": 3.0}, r"algorithm\.loss\.c_clip: does nothing with loss_mode: kl_cov"),
        ({"kl_cov_ratio": 1.5}, r"algorithm\.loss\.kl_cov_ratio: must be in"),
        ({"ppo_kl_coef": -1.0}, r"algorithm\.loss\.ppo_kl_coef: must be >= 0"),
        ({"adv_clip_low": 1.0, "adv_clip_high": -1.0}, r"algorithm\.loss\.adv_clip_high: must be > adv_clip_low"),
        ({"top_entropy_quantile": 0.0}, r"algorithm\.loss\.top_entropy_quantile: must be in \(0"),
        ({"top_entropy_quantile": 1.5}, r"algorithm\.loss\.top_entropy_quantile: must be in \(0"),
    ],
)
def test_mistakes_name_the_key(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        make_loss(**options)


def test_without_prepare_the_selection_is_missing() -> None:
    batch = make_rl_batch(seed=0)
    with pytest.raises(KeyError, match="cov_selected"):
        make_loss(loss_mode="kl_cov")(batch, batch["old_logprobs"], torch.zeros_like(batch["old_logprobs"]))


# --------------------------------------------------------------------------- a real run


def test_tiny_grpo_runs_with_each_option(tmp_path) -> None:
    """``core-rl train`` on the tiny model completes with each option, and each acts (its tokens
    are selected and the metrics are logged)."""
    import json

    for dist in ("core_rl_fsdp", "core_rl_hf", "core_rl_reward_match"):
        pytest.importorskip(dist)
    from core_rl.builtin.loggers import read_metrics
    from core_rl.testing.launch import run_train, write_grpo_config
    from core_rl.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", alphabet="ab=", hidden_size=16, num_heads=2, seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in ("ab", "ba")))
    runs = {
        "clip_cov": {
            "loss_mode": "clip_cov",
            "clip_cov_ratio": 0.25,
            "clip_cov_lb": -10.0,
            "clip_cov_ub": 10.0,
            "top_entropy_quantile": 0.5,
        },
        "kl_cov": {
            "loss_mode": "kl_cov",
            "kl_cov_ratio": 0.25,
            "ppo_kl_coef": 1.0,
            "adv_clip_low": -0.5,
            "adv_clip_high": 0.5,
        },
    }
    for name, loss in runs.items():
        out = tmp_path / name
        out.mkdir()
        config = write_grpo_config(
            out,
            model,
            [str(data)],
            algorithm={"name": "grpo", "loss": {"name": "ppo_clip", **loss}},
            data={"train_files": [str(data)], "batch_size": 2},
            rollout={"engine": {"name": "hf"}, "sampling": {"n": 4, "max_new_tokens": 4, "temperature": 1.0}},
            trainer={"total_steps": 2},
            saver={"export_hf": False},
            loggers=[{"name": "jsonl"}],
            # partial credit: the groups' answers score apart, so every step trains (a step whose
            # every advantage is 0 skips its forward pass, and with it the token metrics)
            reward={"name": "char_match"},
        )
        run_train(config, cpu=True)
        rows = read_metrics(next((out / "runs").rglob("metrics.jsonl")))
        assert [r["step"] for r in rows] == [1, 2], name
        for row in rows:
            assert row["actor/zero_signal_update"] == 0.0, (name, row)
            assert row["actor/cov_selected_fraction"] > 0, (name, row)
            if name == "clip_cov":  # about half of the tokens keep their policy gradient
                assert 0 < row["actor/entropy_kept"] < 1, row
            assert row["actor/grad_norm"] >= 0
