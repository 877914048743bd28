"""``ppo_clip``'s sequence level (GSPO), decoupled loss, rejection sampling, SAPO, off-policy sequence
masking and M2PO against hand-computed values, and the configuration rules that tie them together."""

from __future__ import annotations

import math

import core_rl.builtin.rejection as builtin_rejection
import core_rl_grpo.plugin as grpo_plugin
import pytest
import torch
from core_rl.config import load_config
from core_rl.config.loader import structure
from core_rl.errors import ConfigError
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import POLICY_LOSS, REJECTION_SAMPLER
from core_rl.protocol import TensorBatch
from core_rl.testing import recipe_host
from core_rl_grpo.config import PPOClipConfig
from core_rl_grpo.losses import PPOClipLoss

LN2 = math.log(2.0)


def host() -> PluginHost:
    h = PluginHost(entry_points=[])
    h.register_plugin(grpo_plugin, distribution="core-rl-grpo")
    h.register_plugin(builtin_rejection, distribution="core-rl")
    return h


def make_loss(rejection: dict | None = None, **options: object) -> PPOClipLoss:
    h = host()
    entry = h.get(POLICY_LOSS, "ppo_clip")
    loss = entry.factory(structure(options, entry.config_cls, path="algorithm.loss"))
    if rejection is not None:
        name = rejection.pop("name")
        sampler_entry = h.get(REJECTION_SAMPLER, name)
        loss.set_rejection_sampler(sampler_entry.factory(structure(rejection, sampler_entry.config_cls)))
    return loss


def batch_of(
    log_ratio: list[list[float]],
    advantages: list[float],
    *,
    behave_shift: list[list[float]] | None = None,
    mask: list[list[float]] | None = None,
) -> tuple[TensorBatch, torch.Tensor]:
    """Rows whose current/old log-ratios are ``log_ratio``; ``behave = old - behave_shift`` (so the
    behaviour weight pi_old / pi_behave is ``exp(behave_shift)``)."""
    lr = torch.tensor(log_ratio)
    m = torch.tensor(mask) if mask is not None else torch.ones_like(lr)
    old = torch.full_like(lr, -1.0) * m
    shift = torch.tensor(behave_shift) if behave_shift is not None else torch.zeros_like(lr)
    lp = ((old + lr) * m).requires_grad_(True)
    batch = TensorBatch(
        {
            "response_mask": m,
            "loss_mask": m.clone(),
            "old_logprobs": old,
            "behave_logprobs": (old - shift) * m,
            "advantages": torch.tensor(advantages)[:, None] * m,
            "versions": torch.where(m != 0, 0, -1),
            "train_version": torch.ones(lr.shape[0], dtype=torch.long),
        }
    )
    return batch, lp


def run(loss: PPOClipLoss, batch: TensorBatch, lp: torch.Tensor):
    out = loss(batch, lp, torch.zeros_like(lp))
    weights = loss.loss_weights(batch["loss_mask"])
    (out.per_token_loss * weights).sum().backward()
    return out, weights


def close(got: torch.Tensor, want) -> None:
    torch.testing.assert_close(got.detach(), torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- GSPO


def test_sequence_level_ratio_clips_whole_sequences():
    # row 0: token log-ratios [ln 1.21, 0] -> s = 1.21^(1/2) = 1.1 (inside [0.8, 1.2]), A = 1
    #        l = -1.1 per token; d/d lp_t = -A s w_t with seq-mean-token-mean w = 1/(2*2)
    # row 1: [ln 1.69, 0] -> s = 1.3 > 1.2, A = 1: clipped, l = -1.2, gradient 0
    loss = make_loss(importance_sampling_level="sequence", aggregation="seq-mean-token-mean")
    batch, lp = batch_of([[math.log(1.21), 0.0], [math.log(1.69), 0.0]], [1.0, 1.0])
    out, _ = run(loss, batch, lp)
    close(out.per_token_loss, [[-1.1, -1.1], [-1.2, -1.2]])
    close(out.token_metrics["ratio"], [[1.1, 1.1], [1.3, 1.3]])
    close(out.token_metrics["clipped"], [[0.0, 0.0], [1.0, 1.0]])
    close(lp.grad, [[-1.1 / 4, -1.1 / 4], [0.0, 0.0]])


# --------------------------------------------------------------------------- decoupled loss


def test_decoupled_loss_weights_by_proximal_over_behaviour():
    # old (= proximal) -1; behave -1 - ln 2 -> w = 2 on token 0, 1 on token 1; ratio 1; A = 1
    # l = -A * 1 * w = [-2, -1]; gradient -A w / 2 (token-mean)
    loss = make_loss(use_decoupled_loss=True)
    assert loss.requires_recompute
    batch, lp = batch_of([[0.0, 0.0]], [1.0], behave_shift=[[LN2, 0.0]])
    out, _ = run(loss, batch, lp)
    close(out.per_token_loss, [[-2.0, -1.0]])
    close(out.token_metrics["behave_weight"], [[2.0, 1.0]])
    close(out.token_metrics["behave_weight_max"], [[2.0, 1.0]])
    # k3 estimate of KL(pi_behave || pi_prox) per token: r - 1 - ln r with r = 2: 1 - ln 2
    close(out.token_metrics["kl_behave_prox"], [[1 - LN2, 0.0]])
    close(lp.grad, [[-1.0, -0.5]])


@pytest.mark.parametrize(
    ("rejection", "loss_values", "rejected", "clamped"),
    [
        # weights [2, 1, 0.25]: ratio mask in [0.5, 1.5] rejects tokens 0 and 2
        ({"name": "ratio", "upper": 1.5, "lower": 0.5}, [0.0, -1.0, 0.0], [1.0, 0.0, 1.0], None),
        # TIS to [0.5, 1.5]: weights 1.5, 1, 0.5
        ({"name": "tis", "upper": 1.5, "lower": 0.5}, [-1.5, -1.0, -0.5], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]),
        # sequence-level MIS on the geometric mean (2 * 1 * 0.25)^(1/3) = 0.7937 in [0.5, 1.5]: kept,
        # every token weighs 0.7937
        ({"name": "mis", "level": "sequence", "upper": 1.5, "lower": 0.5}, [-(0.5 ** (1 / 3))] * 3, [0.0] * 3, None),
        # k3 per token: r - 1 - ln r = [0.3069, 0, 0.6363]; upper 0.5 rejects token 2
        ({"name": "kl_k3", "upper": 0.5}, [-2.0, -1.0, 0.0], [0.0, 0.0, 1.0], None),
    ],
)
@pytest.mark.parametrize("decoupled", [True, False])
def test_rejection_sampling_masks_or_clamps_the_weight(rejection, loss_values, rejected, clamped, decoupled):
    # the plain loss weights its surrogate by the sampler's pi_old / pi_behave: with a recomputed
    # pi_old equal to the decoupled loss's recomputed pi_prox, both give the same loss
    loss = make_loss(rejection=dict(rejection), use_decoupled_loss=decoupled)
    batch, lp = batch_of([[0.0, 0.0, 0.0]], [1.0], behave_shift=[[LN2, 0.0, math.log(0.25)]])
    out, _ = run(loss, batch, lp)
    close(out.per_token_loss, [loss_values])
    close(out.token_metrics["rejected"], [rejected])
    if clamped is not None:
        close(out.token_metrics["clamped"], [clamped])


def test_loglinear_proximal_policy():
    # train version 3; token versions [2, 1]: alpha 0 and 1/2; behave -1 (shift 0), current
    # log-ratio to old: [ln 2, ln 2] -> current lp = -1 + ln 2 on both tokens
    #   token 0: prox = behave = -1 -> ratio 2 (clipped at 1.2 for A = 1)
    #   token 1: prox = -1 + ln2 / 2 -> ratio sqrt 2 (clipped too); weight exp(prox - behave) = sqrt 2
    loss = make_loss(use_decoupled_loss=True, prox_logp_method="loglinear")
    assert not loss.requires_recompute
    batch, lp = batch_of([[LN2, LN2]], [1.0])
    batch["versions"] = torch.tensor([[2, 1]])
    batch["train_version"] = torch.tensor([3])
    out, _ = run(loss, batch, lp)
    close(out.token_metrics["ratio"], [[2.0, math.sqrt(2.0)]])
    close(out.token_metrics["behave_weight"], [[1.0, math.sqrt(2.0)]])
    close(out.per_token_loss, [[-1.2, -1.2 * math.sqrt(2.0)]])


def test_metrics_method_reports_the_loglinear_error():
    # recomputed prox = old = -1; loglinear prox for token version 0, train version 2 (alpha 1/2):
    # behave -1 - ln 2 + (current -1 - behave) / 2 = -1 - ln2/2 -> error ln2 / 2
    loss = make_loss(use_decoupled_loss=True, prox_logp_method="metrics")
    assert loss.requires_recompute
    batch, lp = batch_of([[0.0]], [1.0], behave_shift=[[LN2]])
    batch["train_version"] = torch.tensor([2])
    out, _ = run(loss, batch, lp)
    close(out.token_metrics["prox_loglinear_abs_error"], [[LN2 / 2]])


# --------------------------------------------------------------------------- SAPO, off-policy masking, M2PO


def test_sapo_replaces_the_clip():
    # on-policy (r = 1): l = -A * 4/tau * 1/2 = -2A/tau; tau_pos 0.5 for A = 1, tau_neg 2 for A = -1
    # gradient: -A f'(1) = -A; token-mean weight 1/2
    loss = make_loss(use_sapo_loss=True, sapo_tau_pos=0.5, sapo_tau_neg=2.0)
    batch, lp = batch_of([[0.0], [0.0]], [1.0, -1.0])
    out, _ = run(loss, batch, lp)
    close(out.per_token_loss, [[-4.0], [1.0]])
    close(out.token_metrics["sapo_gate"], [[1.0], [1.0]])
    assert "clipped" not in out.token_metrics
    close(lp.grad, [[-0.5], [0.5]])


def test_off_policy_sequence_masking_drops_drifted_negative_sequences():
    # behave - current: row 0 (A = -1) log-ratio -0.5 -> drift 0.5 > 0.3: dropped;
    # row 1 (A = -1) drift 0.1: kept; row 2 (A = +1) drift 0.5: kept (only negative advantages)
    loss = make_loss(off_policy_mask_threshold=0.3)
    batch, lp = batch_of([[-0.5], [-0.1], [-0.5]], [-1.0, -1.0, 1.0])
    out, _ = run(loss, batch, lp)
    close(out.token_metrics["off_policy_masked"], [[1.0], [0.0], [0.0]])
    assert out.per_token_loss[0, 0] == 0 and lp.grad[0, 0] == 0
    assert out.per_token_loss[1, 0] != 0


def test_m2po_prepare_drops_tokens_by_the_batch_second_moment():
    # behave - old per token: [2, 1, 0.5, 0.1] -> m2 [4, 1, 0.25, 0.01]; threshold 0.5 drops the 4
    loss = make_loss(use_decoupled_loss=True, m2_threshold=0.5)
    batch, _ = batch_of([[0.0, 0.0], [0.0, 0.0]], [1.0, 1.0], behave_shift=[[2.0, 1.0], [0.5, 0.1]])
    metrics = loss.prepare(batch)
    assert batch["loss_mask"].tolist() == [[0.0, 1.0], [1.0, 1.0]]
    assert metrics["m2po_masked_fraction"] == pytest.approx(0.25)
    assert metrics["m2po_m2_before"] == pytest.approx(5.26 / 4, rel=1e-5)
    assert metrics["m2po_m2_after"] == pytest.approx(1.26 / 3, rel=1e-5)
    assert make_loss().prepare(batch) == {}


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"use_decoupled_loss": True, "prox_logp_method": "bogus"}, r"prox_logp_method: must be one of 'recompute'"),
        ({"prox_logp_method": "loglinear"}, r"prox_logp_method: applies only with use_decoupled_loss: true"),
        ({"c_clip": 0.9}, r"c_clip: must be > 1"),
        ({"eps_clip_higher": 0.1}, r"eps_clip_higher: must be >= eps_clip \(0.2\)"),
        ({"use_sapo_loss": True, "use_decoupled_loss": True}, r"use_decoupled_loss: cannot be combined with use_sapo"),
        ({"use_sapo_loss": True, "c_clip": 3.0}, r"c_clip: cannot be combined with use_sapo_loss"),
        ({"m2_threshold": 0.1}, r"m2_threshold: needs use_decoupled_loss: true"),
        (
            {"m2_threshold": 0.1, "use_decoupled_loss": True, "prox_logp_method": "loglinear"},
            r"m2_threshold: needs use_decoupled_loss: true with prox_logp_method 'recompute' or 'metrics'",
        ),
        ({"importance_sampling_level": "group"}, r"importance_sampling_level: must be one of 'token', 'sequence'"),
        ({"sapo_tau_neg": 0.0}, r"sapo_tau_neg: must be > 0"),
    ],
)
def test_bad_combinations_name_the_keys(options, message):
    with pytest.raises(ConfigError, match=r"algorithm\.loss\." + message):
        structure(options, PPOClipConfig, path="algorithm.loss")


def test_a_rejection_sampler_makes_the_plain_loss_recompute_its_old_logprobs():
    # without a recompute old_logprobs are the behaviour log-probs and the weight would be 1
    plain = make_loss()
    assert not plain.requires_recompute
    batch, lp = batch_of([[0.0]], [1.0], behave_shift=[[LN2]])
    assert "behave_weight" not in run(plain, batch, lp)[0].token_metrics  # no weight without a sampler
    corrected = make_loss(rejection={"name": "tis", "upper": 1.5})
    assert corrected.requires_recompute
    out, _ = run(corrected, *batch_of([[0.0]], [1.0], behave_shift=[[LN2]]))
    close(out.per_token_loss, [[-1.5]])  # weight 2 truncated at 1.5
    corrected.set_rejection_sampler(None)
    assert not corrected.requires_recompute
    # the decoupled loss recomputes pi_prox whatever the sampler, unless it is log-linear
    assert make_loss(use_decoupled_loss=True).requires_recompute
    loglinear = make_loss(rejection={"name": "tis"}, use_decoupled_loss=True, prox_logp_method="loglinear")
    assert not loglinear.requires_recompute


def _load(*overrides: str):
    host = recipe_host((grpo_plugin, "core-rl-grpo"))
    return load_config(None, ["algorithm.name=grpo", *overrides], host=host, require_complete=False)


def test_cross_section_rules_are_config_errors():
    assert _load("algorithm.rejection_sampling.name=tis").algorithm.rejection_sampling.name == "tis"  # plain loss
    with pytest.raises(ConfigError, match=r"algorithm\.recompute_logprob: true contradicts algorithm\.loss"):
        _load(
            "algorithm.recompute_logprob=true",
            "algorithm.loss.use_decoupled_loss=true",
            "algorithm.loss.prox_logp_method=loglinear",
        )
    cfg = _load(
        "algorithm.loss.use_decoupled_loss=true",
        "algorithm.rejection_sampling={name: ratio, level: sequence, agg: sum, upper: 3.0}",
        "rollout.sampling.max_new_tokens=48",
    )
    assert cfg.algorithm.rejection_sampling.config.agg == "sum"
    assert cfg.algorithm.loss.config.norm_length == 48  # the response budget by default


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rejection", [None, {"name": "ratio", "lower": 0.5, "upper": 2.0}])
def test_stale_samples_from_unchanged_weights_give_the_on_policy_gradient(seed: int, rejection: dict | None) -> None:
    """A sample one version behind whose weights did not change (behaviour = proximal log-probs):
    the decoupled loss, with or without rejection sampling, has the on-policy loss and gradient."""
    g = torch.Generator().manual_seed(seed)
    log_ratio = (0.3 * torch.randn(4, 6, generator=g)).tolist()
    advantages = torch.randn(4, generator=g).tolist()
    mask = (torch.rand(4, 6, generator=g) > 0.2).float().tolist()
    stale, lp_stale = batch_of(log_ratio, advantages, mask=mask)  # behave == old (proximal)
    stale["versions"] = torch.where(stale["response_mask"] != 0, 0, -1)
    stale["train_version"] = torch.full((4,), 2, dtype=torch.long)  # one version behind pi_prox
    fresh, lp_fresh = batch_of(log_ratio, advantages, mask=mask)
    out_stale, _ = run(make_loss(dict(rejection) if rejection else None, use_decoupled_loss=True), stale, lp_stale)
    out_fresh, _ = run(make_loss(), fresh, lp_fresh)
    torch.testing.assert_close(out_stale.per_token_loss, out_fresh.per_token_loss)
    torch.testing.assert_close(lp_stale.grad, lp_fresh.grad)
