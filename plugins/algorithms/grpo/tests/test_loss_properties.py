"""Property tests (hypothesis) of ``ppo_clip`` over varied batches and option combinations:

- the loss and its gradient do not depend on the split into micro-batches or data-parallel ranks;
- with one-token responses the sequence level (GSPO) equals token-level PPO;
- the decoupled loss with proximal = behaviour policy equals plain PPO;
- rejection sampling with infinite bounds changes nothing;
- parity with the loop-per-sequence reference formulation (core_rl.testing.reference; GMPO there in
  ratio space), Clip-Cov and KL-Cov given the tokens ``prepare`` selected (the selection itself:
  test_entropy_control.py).
"""

from __future__ import annotations

from typing import Any

import core_rl.builtin.rejection as builtin_rejection
import core_rl_grpo.plugin as grpo_plugin
import pytest
import torch
from core_rl.config.loader import structure
from core_rl.plugins.host import PluginHost
from core_rl.plugins.kinds import POLICY_LOSS, REJECTION_SAMPLER
from core_rl.protocol import TensorBatch
from core_rl.testing import reference
from core_rl_grpo.losses import PPOClipLoss
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=30, deadline=None)

OPTION_SETS: list[dict[str, Any]] = [
    {},
    {"eps_clip_higher": 0.28, "c_clip": 3.0, "aggregation": "seq-mean-token-mean"},
    {"importance_sampling_level": "sequence", "aggregation": "seq-mean-token-mean", "kl_coef": 0.1},
    {"aggregation": "seq-mean-token-sum-norm", "norm_length": 9, "entropy_coef": 0.01, "kl_estimator": "k2"},
    {"use_decoupled_loss": True, "aggregation": "seq-mean-token-sum"},
    {"use_decoupled_loss": True, "_rejection": {"name": "ratio", "upper": 1.3, "lower": 0.8}},
    {"use_decoupled_loss": True, "_rejection": {"name": "tis", "level": "sequence", "agg": "sum", "upper": 1.5}},
    {"use_decoupled_loss": True, "_rejection": {"name": "kl_k2", "level": "sequence", "agg": "max", "upper": 0.05}},
    {"use_decoupled_loss": True, "prox_logp_method": "loglinear", "importance_sampling_level": "sequence"},
    {"use_sapo_loss": True, "sapo_tau_pos": 0.7, "off_policy_mask_threshold": 0.05},
    {"use_cispo_loss": True, "cispo_eps_low": 0.5, "importance_sampling_level": "sequence", "kl_coef": 0.1},
    {"off_policy_mask_threshold": 0.0, "kl_coef": 0.2, "kl_estimator": "k1"},
    {"use_gmpo_loss": True, "aggregation": "seq-mean-token-mean", "kl_coef": 0.1, "off_policy_mask_threshold": 0.05},
    {"use_gmpo_loss": True, "gmpo_eps_low": 0.1, "gmpo_eps_high": 0.3, "adv_clip_high": 0.5, "entropy_coef": 0.01},
    {"loss_mode": "clip_cov", "clip_cov_ratio": 0.3, "clip_cov_lb": -1.0, "clip_cov_ub": 1.0, "c_clip": 3.0},
    {"loss_mode": "kl_cov", "kl_cov_ratio": 0.3, "ppo_kl_coef": 0.5, "aggregation": "seq-mean-token-mean"},
    {"loss_mode": "kl_cov", "kl_cov_ratio": 0.2, "importance_sampling_level": "sequence", "use_decoupled_loss": True},
    {"adv_clip_low": -0.5, "adv_clip_high": 0.8, "c_clip": 3.0, "positive_nll_coef": 0.0},
    {"adv_clip_high": 0.3, "loss_mode": "clip_cov", "clip_cov_ratio": 0.5, "clip_cov_lb": -2.0, "clip_cov_ub": 2.0},
]


def make_loss(options: dict[str, Any]) -> PPOClipLoss:
    options = dict(options)
    rejection = options.pop("_rejection", None)
    host = PluginHost(entry_points=[])
    host.register_plugin(grpo_plugin, distribution="core-rl-grpo")
    host.register_plugin(builtin_rejection, distribution="core-rl")
    entry = host.get(POLICY_LOSS, "ppo_clip")
    loss = entry.factory(structure(options, entry.config_cls))
    if rejection is not None:
        rejection = dict(rejection)
        sampler = host.get(REJECTION_SAMPLER, rejection.pop("name"))
        loss.set_rejection_sampler(sampler.factory(structure(rejection, sampler.config_cls)))
    return loss


@st.composite
def rl_batches(draw, *, max_response: int = 6, one_token: bool = False):
    """A right-padded batch with every key the loss reads, and current log-probs off-policy by a
    drawn amount. Returns (batch, logprobs, entropy)."""
    rows = draw(st.integers(2, 7))
    prompt = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    drift = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    g = torch.Generator().manual_seed(seed)
    lengths = [1] * rows if one_token else [draw(st.integers(1, max_response)) for _ in range(rows)]
    width = prompt + max(lengths)
    mask = torch.zeros(rows, width)
    for i, n in enumerate(lengths):
        mask[i, prompt : prompt + n] = 1.0
    old = -torch.rand(rows, width, generator=g) * 3 * mask
    behave = (old + torch.randn(rows, width, generator=g) * drift * 0.3) * mask
    versions = torch.where(mask != 0, torch.randint(0, 3, (rows, 1), generator=g), -1)
    batch = TensorBatch(
        {
            "response_mask": mask,
            "loss_mask": mask.clone(),
            "old_logprobs": old,
            "behave_logprobs": behave,
            "ref_logprobs": -torch.rand(rows, width, generator=g) * 3 * mask,
            "advantages": torch.randn(rows, 1, generator=g) * mask,
            "versions": versions,
            "train_version": torch.full((rows,), 3, dtype=torch.long),
        }
    )
    logprobs = (old + torch.randn(rows, width, generator=g) * drift) * mask
    entropy = torch.rand(rows, width, generator=g) * mask
    return batch, logprobs, entropy


def loss_and_grad(loss: PPOClipLoss, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor, parts):
    """The weighted loss and d loss / d logprobs, summed over the row ``parts`` of ``batch`` (after
    the loss's ``prepare`` on the whole batch, as the trainer calls it)."""
    loss.prepare(batch)
    weights = loss.loss_weights(batch["loss_mask"])
    lp = logprobs.clone().requires_grad_(True)
    total = torch.zeros(())
    for rows in parts:
        mb = batch.rows(rows)
        part = (loss(mb, lp[rows], entropy[rows]).per_token_loss * weights[rows]).sum()
        part.backward()
        total = total + part.detach()
    return total, lp.grad


@SETTINGS
@given(rl_batches(), st.sampled_from(OPTION_SETS), st.integers(1, 3), st.data())
def test_loss_and_gradient_do_not_depend_on_micro_batches_or_ranks(data, options, ranks, draw):
    batch, logprobs, entropy = data
    loss = make_loss(options)
    rows = batch.batch_size
    whole, whole_grad = loss_and_grad(loss, batch, logprobs, entropy, [slice(0, rows)])
    cuts = sorted(draw.draw(st.lists(st.integers(1, rows - 1), max_size=3, unique=True)))
    micro = [slice(a, b) for a, b in zip([0, *cuts], [*cuts, rows])]
    strided = [torch.arange(r, rows, ranks) for r in range(ranks) if r < rows]  # rank r's rows
    for parts in (micro, strided):
        total, grad = loss_and_grad(loss, batch, logprobs, entropy, parts)
        torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7)


@SETTINGS
@given(
    rl_batches(one_token=True),
    st.sampled_from([o for o in OPTION_SETS if not {"importance_sampling_level", "use_gmpo_loss"} & set(o)]),
)
def test_sequence_level_with_one_token_responses_is_token_level_ppo(data, options):
    batch, logprobs, entropy = data
    parts = [slice(0, batch.batch_size)]
    token = loss_and_grad(make_loss(options), batch, logprobs, entropy, parts)
    sequence = loss_and_grad(
        make_loss({**options, "importance_sampling_level": "sequence"}), batch, logprobs, entropy, parts
    )
    torch.testing.assert_close(sequence[0], token[0])
    torch.testing.assert_close(sequence[1], token[1])


@SETTINGS
@given(rl_batches(), st.sampled_from(["token", "sequence"]), st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_decoupled_loss_with_proximal_equal_to_behaviour_is_plain_ppo(data, level, aggregation):
    batch, logprobs, entropy = data
    batch["behave_logprobs"] = batch["old_logprobs"].clone()
    parts = [slice(0, batch.batch_size)]
    base = {"importance_sampling_level": level, "aggregation": aggregation, "c_clip": 2.5}
    plain = loss_and_grad(make_loss(base), batch, logprobs, entropy, parts)
    decoupled = loss_and_grad(make_loss({**base, "use_decoupled_loss": True}), batch, logprobs, entropy, parts)
    torch.testing.assert_close(decoupled[0], plain[0])
    torch.testing.assert_close(decoupled[1], plain[1])


#: (sampler, level) pairs whose weight is the token ratio (at sequence level the ratio metric's
#: weight is the sequence ratio by definition, so it is not the unbounded decoupled loss)
TOKEN_WEIGHT_SAMPLERS = [("ratio", "token"), ("mis", "token")] + [
    (name, level) for name in ("kl_k1", "kl_k2", "kl_k3") for level in ("token", "sequence")
]


@SETTINGS
@given(rl_batches(), st.sampled_from(TOKEN_WEIGHT_SAMPLERS), st.sampled_from(["sum", "mean", "max"]))
def test_rejection_without_bounds_changes_nothing(data, sampler, agg):
    """No bounds (``upper: null``, ``lower: null``; the config refuses infinities) keep every token
    with weight pi_prox / pi_behave: the same loss and gradient as no rejection sampling."""
    batch, logprobs, entropy = data
    name, level = sampler
    parts = [slice(0, batch.batch_size)]
    unbounded = {"name": name, "level": level, "agg": agg, "upper": None, "lower": None}
    base = {"use_decoupled_loss": True}
    without = loss_and_grad(make_loss(base), batch, logprobs, entropy, parts)
    with_sampler = loss_and_grad(make_loss({**base, "_rejection": unbounded}), batch, logprobs, entropy, parts)
    torch.testing.assert_close(with_sampler[0], without[0])
    torch.testing.assert_close(with_sampler[1], without[1])


def _spec(options: dict[str, Any]) -> reference.LossSpec:
    options = dict(options)
    return reference.spec_from_options(options, options.pop("_rejection", None))


def reference_loss_and_grad(batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor, spec):
    lp = logprobs.clone().requires_grad_(True)
    seqs = []
    for i in range(batch.batch_size):
        on = batch["response_mask"][i] != 0
        seqs.append(
            {
                "logprobs": lp[i][on],
                "old": batch["old_logprobs"][i][on],
                "behave": batch["behave_logprobs"][i][on],
                "ref": batch["ref_logprobs"][i][on],
                "adv": batch["advantages"][i][on],
                "entropy": entropy[i][on],
                "versions": batch["versions"][i][on],
                "train_version": batch["train_version"][i],
                "cov_selected": batch["cov_selected"][i][on] != 0 if "cov_selected" in batch else None,
            }
        )
    total = reference.policy_loss(seqs, spec)
    total.backward()
    return total.detach(), lp.grad


@SETTINGS
@given(rl_batches(), st.sampled_from(OPTION_SETS))
def test_parity_with_the_loop_per_sequence_reference(data, options):
    batch, logprobs, entropy = data
    got = loss_and_grad(make_loss(options), batch, logprobs, entropy, [slice(0, batch.batch_size)])
    want = reference_loss_and_grad(batch, logprobs, entropy, _spec(options))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


#: whether ``ppo_clip`` with each option set (those above and a few more) has a gradient when every
#: advantage is 0: with a KL penalty, an entropy bonus (fixed or adaptive), a KL-Cov penalty (whose
#: selection always holds a token) or an advantage clip that lifts 0 to a bound, and else not
ZERO_ADVANTAGE_GRADIENT: list[tuple[dict[str, Any], bool]] = [
    (OPTION_SETS[0], False),
    (OPTION_SETS[1], False),
    (OPTION_SETS[2], True),  # kl_coef
    (OPTION_SETS[3], True),  # entropy_coef
    *((OPTION_SETS[i], False) for i in range(4, 10)),  # decoupled (with rejection), SAPO, off-policy masking
    *((OPTION_SETS[i], True) for i in range(10, 14)),  # kl_coef or entropy_coef beside CISPO, GMPO
    (OPTION_SETS[14], False),  # clip_cov
    (OPTION_SETS[15], True),  # kl_cov
    (OPTION_SETS[16], True),  # kl_cov, ppo_kl_coef by default
    (OPTION_SETS[17], False),
    (OPTION_SETS[18], False),
    ({"loss_mode": "kl_cov", "kl_cov_ratio": 0.3, "ppo_kl_coef": 0.0}, False),
    ({"positive_nll_coef": 0.5, "top_entropy_quantile": 0.5}, False),
    ({"use_decoupled_loss": True, "m2_threshold": 0.01}, False),
    ({"use_gmpo_loss": True, "aggregation": "seq-mean-token-mean"}, False),
    ({"use_cispo_loss": True}, False),
    ({"entropy_target": 0.2}, True),
    ({"adv_clip_low": 0.1}, True),
]


def token_gradients(loss: PPOClipLoss, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
    """d/d logprobs and d/d entropy of the weighted loss of the whole (prepared) batch."""
    lp, ent = logprobs.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    total = (loss(batch, lp, ent).per_token_loss * loss.loss_weights(batch["loss_mask"])).sum()
    total.backward()
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in (lp, ent)]


@settings(max_examples=8, deadline=None)
@pytest.mark.parametrize(("options", "expected"), ZERO_ADVANTAGE_GRADIENT)
@given(data=rl_batches(), draw=st.data())
def test_has_gradient_is_false_only_where_the_gradient_is_exactly_zero(options, expected, data, draw):
    """With every advantage 0 (and any advantage off the response and loss tokens, where the loss
    reads none) ``has_gradient`` is ``expected``, and where it is ``False`` the gradient with respect
    to the log-probs and the entropy is exactly 0 for the drawn policy; one advantage on a response
    token, whichever, gives ``True``."""
    batch, logprobs, entropy = data
    loss = make_loss(options)
    on = batch["response_mask"] != 0
    batch["advantages"] = torch.where(on, 0.0, 1.5)  # the prompt's and padding's are never read
    loss.prepare(batch)
    assert loss.has_gradient(batch) is expected
    if not expected:
        for grad in token_gradients(loss, batch, logprobs, entropy):
            assert torch.equal(grad, torch.zeros_like(grad))
    rows, cols = on.nonzero(as_tuple=True)
    pick = draw.draw(st.integers(0, rows.numel() - 1))
    batch["advantages"][rows[pick], cols[pick]] = draw.draw(st.sampled_from([-0.7, 1e-6, 2.0]))
    assert loss.has_gradient(batch) is True
