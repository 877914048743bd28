"""The policy loss ``ppo_clip``: PPO's clipped surrogate at token or sequence level (GSPO), with
clip-higher, dual clipping, a KL penalty towards a reference model, an entropy bonus, and the
off-policy corrections: the decoupled loss (proximal policy by recompute or log-linear
interpolation) with rejection sampling / truncated or masked importance sampling, off-policy
sequence masking, SAPO's soft gate, CISPO's clipped weight, GMPO's geometric mean and M2PO; and
against entropy collapse, Clip-Cov and KL-Cov.

The formulas live in :mod:`core_rl.ops`; this module composes them. All tensors are [b, T] and
follow :mod:`core_rl.protocol` (position ``t`` describes token ``t``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from core_rl import ops
from core_rl.interfaces import LossOutput, PolicyLoss, RejectionSampler
from core_rl.ops import policy_ratio, ppo_clip_loss
from core_rl.protocol import TensorBatch

from core_rl_grpo.config import PPOClipConfig
from core_rl_grpo.covariance import select_tokens

__all__ = ["PPOClipConfig", "PPOClipLoss", "policy_ratio", "ppo_clip_loss"]


class PPOClipLoss(PolicyLoss):
    """Per-token loss (see the README for every term)::

        A_t    = clip(A_t, adv_clip_low, adv_clip_high)   with either bound set (every term below)
        rho_t  = pi(y_t) / pi_anchor(y_t)      token level, or the GSPO sequence ratio at sequence level;
                                               pi_anchor = pi_prox (decoupled) or pi_old
        l_t    = ppo_clip_loss(rho_t, A_t)     or sapo_loss(rho_t, A_t) with use_sapo_loss,
                                               or cispo_loss(rho_t, A_t) with use_cispo_loss
        l_t    = -A_i g_i                      with use_gmpo_loss: GMPO's loss of the token's sequence i,
                                               g_i the geometric mean of its clipped token ratios
                                               (ops.gmpo_loss; mean over the loss_mask tokens)
        l_t    = 0 where t in S and not clipped            loss_mode clip_cov (ops.clip_cov_loss)
        l_t    = -A_t rho_t + ppo_kl_coef |log rho_t| [t in S]   loss_mode kl_cov (unclipped; ops.kl_cov_loss)
        l_t    = l_t * w_t                     decoupled: w_t = pi_prox / pi_behave (after rejection sampling);
                                               plain, with a rejection sampler: w_t = its weight of
                                               pi_old / pi_behave (old_logprobs then recomputed)
        l_t    = l_t * [H_t >= tau_q]          top_entropy_quantile q < 1 (tau_q below)
        l_t    = l_t + kl_coef * KL_est(pi, pi_ref) - entropy_coef * H_t
                                               (KL_est times rho_t with kl_importance_weight)
        l_t    = l_t + positive_nll_coef * (-log pi(y_t)) * [A_t > 0]
        l_t    = l_t * keep_t * mask_t         keep: rejection sampling, off-policy sequence masking

    The positive-advantage NLL (an SFT term on the samples that did well, as VAPO's) is aggregated by
    the loss's own ``aggregation`` weights ``w`` like every other term, so it adds
    ``positive_nll_coef * sum_{i,t} w_{i,t} * (-log pi_{i,t}) * [A_{i,t} > 0]`` to the loss: with
    ``token-mean``, the NLL summed over the positive tokens divided by *all* loss tokens of the
    minibatch (not by the positive ones alone), which keeps the split into micro-batches and ranks
    exact. Outcome estimators (``grpo``, ``rloo``) give every token of a sample its advantage, so the
    positive tokens are the tokens of the samples with a positive advantage. Off (0) the loss is
    bitwise the loss without it.

    ``S`` (``loss_mode`` ``clip_cov``/``kl_cov``) is chosen once per step on the global batch by
    :meth:`prepare` from the covariance of log-prob and advantage (:mod:`core_rl_grpo.covariance`:
    scope and seeding); Clip-Cov's tokens leave the loss, KL-Cov's are pulled back towards the
    anchor policy.

    ``top_entropy_quantile = q < 1`` (the 80/20 rule, Wang et al. 2025): ``tau_q`` is the ``1 - q``
    quantile (linear interpolation) of the entropies ``H_t`` of the micro-batch's loss tokens
    (``loss_mask``) on this rank, read without gradient (:func:`core_rl.ops.top_quantile_mask`); the
    other tokens lose the policy-gradient term only (the KL, entropy and NLL terms stay) and still
    count in the aggregation's denominators. The engine hands the loss the current policy's entropy
    one micro-batch at a time, so the population is the micro-batch: the loss depends on the
    micro-batch split (with one micro-batch per rank and one rank, the population is the minibatch).

    Token metrics (0 off the response): ``ratio``, ``ratio_max``, ``clipped`` (with GMPO: the tokens
    whose log-ratio its clip bounds on the pessimistic side), ``dual_clipped``,
    ``sapo_gate``, ``cispo_truncated``, ``approx_kl`` (k3 estimate of KL(pi_anchor || pi)), ``kl``; with the decoupled
    loss ``behave_weight``, ``behave_weight_max``, ``kl_behave_prox``, ``kl_behave_current``,
    ``rejected``, ``clamped``, ``prox_loglinear_abs_error`` (``metrics`` method);
    ``off_policy_masked``; ``cov_clipped`` (clip_cov) or ``cov_penalised`` (kl_cov); ``entropy_kept``;
    ``positive_nll`` (``-log pi`` on positive-advantage tokens, 0 elsewhere)
    with ``positive_nll_coef > 0``.
    """

    def __init__(self, config: PPOClipConfig | None = None) -> None:
        self.config = config if config is not None else PPOClipConfig()
        cfg = self.config
        self.eps_low = cfg.eps_clip
        self.eps_high = cfg.eps_clip_higher if cfg.eps_clip_higher is not None else cfg.eps_clip
        self.requires_reference = cfg.kl_coef > 0
        self.adaptive_entropy = cfg.entropy_target is not None
        self.entropy_grad = cfg.entropy_coef > 0 or self.adaptive_entropy  # otherwise the entropy is a metric only
        self.entropy_coef = cfg.entropy_coef  # the adaptive coefficient, updated by observe_step
        self.last_entropy = math.inf  # no step measured yet: no adaptive bonus at the first step
        self.sampler: RejectionSampler | None = None

    @property
    def requires_recompute(self) -> bool:
        """The decoupled loss's proximal policy, unless log-linear; the plain loss with a rejection
        sampler: its behaviour weight ``pi_old / pi_behave`` needs the trainer's ``old_logprobs``
        (without a recompute they are the behaviour log-probs, and the weight is 1)."""
        cfg = self.config
        if cfg.use_decoupled_loss:
            return cfg.prox_logp_method != "loglinear"
        return self.sampler is not None

    def set_rejection_sampler(self, sampler: RejectionSampler | None) -> None:
        """The sampler corrects the behaviour weight: of the decoupled loss (``pi_prox / pi_behave``),
        or of the plain loss (``pi_old / pi_behave``, truncated importance sampling as a factor on
        the clipped surrogate; the trainer recomputes ``old_logprobs`` from then on,
        :attr:`requires_recompute`)."""
        self.sampler = sampler

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        return ops.aggregation_weights(response_mask, self.config.aggregation, norm_length=self.config.norm_length)

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        """On the whole global batch, before any update: M2PO (``m2_threshold``) drops tokens from
        ``loss_mask`` (:meth:`_m2po`); then ``loss_mode`` ``clip_cov``/``kl_cov`` selects its tokens
        among those left (:func:`core_rl_grpo.covariance.select_tokens`, into ``cov_selected``)."""
        cfg = self.config
        metrics = self._m2po(batch) if cfg.m2_threshold is not None else {}
        if cfg.loss_mode != "clip":
            metrics.update(select_tokens(batch, self._advantages(batch, torch.float32), cfg))
        return metrics

    def _m2po(self, batch: TensorBatch) -> dict[str, float]:
        """M2PO: drop tokens from ``loss_mask`` by the whole batch's second moment of
        ``log pi_behave - log pi_prox`` (:func:`core_rl.ops.m2po_mask`)."""
        assert self.config.m2_threshold is not None
        mask = batch["loss_mask"]
        behave, prox = batch["behave_logprobs"], batch["old_logprobs"]
        keep = ops.m2po_mask(behave, prox, mask, self.config.m2_threshold)
        m2 = (behave - prox).square()
        kept = mask * keep.to(mask.dtype)
        batch["loss_mask"] = kept
        return {
            "m2po_masked_fraction": float(1.0 - kept.sum() / mask.sum().clamp(min=1)),
            "m2po_m2_before": float(ops.masked_mean(m2, mask)),
            "m2po_m2_after": float(ops.masked_mean(m2, kept)),
        }

    def _proximal(
        self, batch: TensorBatch, logprobs: torch.Tensor, behave: torch.Tensor, metrics: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """pi_prox of the decoupled loss: the recomputed ``old_logprobs``, or the log-linear
        interpolation (``loglinear``); ``metrics`` also reports the interpolation's error."""
        method = self.config.prox_logp_method
        if method == "recompute":
            return batch["old_logprobs"].to(logprobs.dtype)
        approx = ops.loglinear_proximal_logprobs(behave, logprobs, batch["versions"], batch["train_version"])
        if method == "loglinear":
            return approx
        prox = batch["old_logprobs"].to(logprobs.dtype)
        metrics["prox_loglinear_abs_error"] = (approx - prox).abs()
        return prox

    def __call__(self, batch: TensorBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> LossOutput:
        cfg = self.config
        mask = batch["response_mask"].to(logprobs.dtype)
        on = mask != 0
        advantages = self._advantages(batch, logprobs.dtype)
        old = batch["old_logprobs"].to(logprobs.dtype)
        behave = batch.get("behave_logprobs", old).to(logprobs.dtype)
        metrics: dict[str, torch.Tensor] = {}

        anchor = self._proximal(batch, logprobs, behave, metrics) if cfg.use_decoupled_loss else old
        log_ratio = ops.importance_log_ratio(logprobs, anchor, mask, cfg.importance_sampling_level)
        ratio = torch.exp(log_ratio)
        if cfg.use_sapo_loss:
            loss, gate = ops.sapo_loss(ratio, advantages, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg)
            metrics["sapo_gate"] = gate
        elif cfg.use_cispo_loss:
            loss, truncated = ops.cispo_loss(ratio, advantages, eps_low=cfg.cispo_eps_low, eps_high=cfg.cispo_eps_high)
            metrics["cispo_truncated"] = truncated.to(mask.dtype)
        elif cfg.use_gmpo_loss:  # one value per sequence, its mean over the sequence's loss tokens
            tokens = batch.get("loss_mask", batch["response_mask"]).to(logprobs.dtype)
            loss, clipped = ops.gmpo_loss(
                log_ratio, advantages, tokens, eps_low=cfg.gmpo_eps_low, eps_high=cfg.gmpo_eps_high
            )
            metrics["clipped"] = clipped.to(mask.dtype)
        elif cfg.loss_mode == "kl_cov":
            selected = self._selected(batch)
            loss = ops.kl_cov_loss(ratio, log_ratio, advantages, selected, cfg.ppo_kl_coef)
            metrics["cov_penalised"] = selected.to(mask.dtype)
        else:
            loss, clipped, dual_clipped = ppo_clip_loss(
                ratio, advantages, eps_low=self.eps_low, eps_high=self.eps_high, c_clip=cfg.c_clip
            )
            metrics["clipped"] = clipped.to(mask.dtype)
            if cfg.c_clip is not None:
                metrics["dual_clipped"] = dual_clipped.to(mask.dtype)
            if cfg.loss_mode == "clip_cov":
                loss, corrected = ops.clip_cov_loss(loss, clipped, self._selected(batch))
                metrics["cov_clipped"] = corrected.to(mask.dtype)
        metrics["ratio"] = ratio.detach()
        metrics["ratio_max"] = ratio.detach()
        metrics["approx_kl"] = ops.kl_estimate(anchor, logprobs.detach(), "k3")

        keep = on
        if cfg.use_decoupled_loss or self.sampler is not None:
            weight, keep = self._behaviour_weight(anchor, behave, mask, keep, metrics)
            loss = loss * weight
            metrics["kl_behave_current"] = ops.kl_estimate(behave, logprobs.detach(), "k3")
        if cfg.off_policy_mask_threshold is not None:
            kept = ops.off_policy_sequence_mask(logprobs, behave, advantages, mask, cfg.off_policy_mask_threshold)
            metrics["off_policy_masked"] = (on & ~kept).to(mask.dtype)
            keep = keep & kept
        if cfg.top_entropy_quantile < 1.0:
            population = batch.get("loss_mask", batch["response_mask"])
            high = ops.top_quantile_mask(entropy, population, cfg.top_entropy_quantile)
            loss = torch.where(high, loss, torch.zeros_like(loss))
            metrics["entropy_kept"] = high.to(mask.dtype)
        if cfg.kl_coef > 0:
            if "ref_logprobs" not in batch:
                raise KeyError("ppo_clip with kl_coef > 0 needs 'ref_logprobs' in the batch (a reference model)")
            kl = ops.kl_estimate(logprobs, batch["ref_logprobs"].to(logprobs.dtype), cfg.kl_estimator)
            metrics["kl"] = kl.detach()
            if cfg.kl_importance_weight:  # rho_t is in the graph: its gradient is part of the estimate
                kl = kl * ratio.expand_as(kl)
            loss = loss + cfg.kl_coef * kl
        entropy_coef = self._entropy_coef_now()
        if entropy_coef > 0:
            loss = loss - entropy_coef * entropy
        if cfg.positive_nll_coef > 0:
            nll = -logprobs * (advantages > 0).to(logprobs.dtype)
            loss = loss + cfg.positive_nll_coef * nll
            metrics["positive_nll"] = nll.detach()
        loss = torch.where(keep, loss, torch.zeros_like(loss)) * mask
        return LossOutput(per_token_loss=loss, token_metrics={k: v * mask for k, v in metrics.items()})

    def has_gradient(self, batch: TensorBatch) -> bool:
        """``False`` exactly when every term above is 0 whatever the policy: no KL penalty
        (``kl_coef = 0``), no entropy bonus (``entropy_coef = 0`` and no ``entropy_target``, whose
        adaptive coefficient follows the entropy every step measures), no KL-Cov penalty on a selected
        token, and every advantage the loss uses (``A_t`` after ``adv_clip_low``/``adv_clip_high``)
        0 on the response and loss tokens. Each surrogate (the clipped one with dual clip and
        Clip-Cov, SAPO, CISPO, GMPO; token or sequence level; decoupled or not) is then ``-A`` times
        a finite factor, and the positive-advantage NLL has no token with ``A_t > 0``."""
        cfg = self.config
        if cfg.kl_coef > 0 or self.entropy_grad:
            return True
        tokens = (batch["response_mask"] != 0) | (batch.get("loss_mask", batch["response_mask"]) != 0)
        if cfg.loss_mode == "kl_cov" and cfg.ppo_kl_coef != 0 and bool((self._selected(batch) & tokens).any()):
            return True
        advantages = self._advantages(batch, batch["advantages"].dtype)
        return bool((advantages[tokens] != 0).any())

    def _entropy_coef_now(self) -> float:
        """The entropy bonus's coefficient this step: ``entropy_coef``, or the adaptive coefficient
        while the last step's entropy was at most ``entropy_target`` (else 0)."""
        if not self.adaptive_entropy:
            return self.config.entropy_coef
        return self.entropy_coef if self.last_entropy <= self.config.entropy_target else 0.0

    def observe_step(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The adaptive entropy coefficient follows the step's mean entropy (``entropy_target``)."""
        if not self.adaptive_entropy:
            return {}
        cfg = self.config
        self.last_entropy = float(metrics["entropy"])
        self.entropy_coef = ops.adaptive_entropy_coef(
            self.entropy_coef,
            self.last_entropy,
            target=cfg.entropy_target,
            delta=cfg.entropy_coef_delta,
            low=cfg.entropy_coef_min,
            high=cfg.entropy_coef_max,
        )
        return {"entropy_coef": self.entropy_coef, "entropy_bonus_on": float(self._entropy_coef_now() > 0)}

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_coef": self.entropy_coef, "last_entropy": self.last_entropy} if self.adaptive_entropy else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.adaptive_entropy and state:
            self.entropy_coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_entropy"])

    def _advantages(self, batch: TensorBatch, dtype: torch.dtype) -> torch.Tensor:
        """The advantages the loss uses: ``clip(A, adv_clip_low, adv_clip_high)`` (cosmos-rl's
        advantage clipping) when a bound is set, else the batch's as they are. Clipped here, in the
        loss, so the estimator's advantages (and their logged statistics) stay unclipped."""
        advantages = batch["advantages"].to(dtype)
        low, high = self.config.adv_clip_low, self.config.adv_clip_high
        if low is None and high is None:
            return advantages
        return advantages.clamp(min=low, max=high)

    def _selected(self, batch: TensorBatch) -> torch.Tensor:
        """The tokens :meth:`prepare` selected for ``loss_mode`` (bool [b, T])."""
        if "cov_selected" not in batch:
            raise KeyError(
                f"ppo_clip with loss_mode {self.config.loss_mode} needs 'cov_selected' in the batch: "
                "call PPOClipLoss.prepare on the global batch first (the trainer does)"
            )
        return batch["cov_selected"] != 0

    def _behaviour_weight(
        self,
        prox: torch.Tensor,
        behave: torch.Tensor,
        mask: torch.Tensor,
        keep: torch.Tensor,
        metrics: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoupled loss's weight ``pi_prox / pi_behave`` (no gradient), after the rejection
        sampler when one is set, and the keep-mask it leaves."""
        if self.sampler is None:
            weight = ops.behaviour_log_ratio(prox, behave).exp() * mask
        else:
            correction = self.sampler(prox.detach(), behave, mask)
            weight = correction.weight.to(mask.dtype)
            metrics["rejected"] = (keep & ~correction.keep).to(mask.dtype)
            if correction.clamped is not None:
                metrics["clamped"] = correction.clamped.to(mask.dtype)
            keep = keep & correction.keep
        metrics["behave_weight"] = weight
        metrics["behave_weight_max"] = weight
        metrics["kl_behave_prox"] = ops.kl_estimate(behave, prox.detach(), "k3")
        return weight, keep
