"""The policy loss ``ppo_clip``: PPO's clipped surrogate at token or sequence level (GSPO), with
clip-higher, dual clipping, a KL penalty towards a reference model, an entropy bonus, and the
off-policy corrections: the decoupled loss (proximal policy by recompute or log-linear
interpolation) with rejection sampling / truncated or masked importance sampling, off-policy
sequence masking, SAPO's soft gate and M2PO.

The formulas live in :mod:`core_rl.ops`; this module composes them. All tensors are [b, T] and
follow :mod:`core_rl.protocol` (position ``t`` describes token ``t``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch
from core_rl import ops
from core_rl.config.schema import default_from
from core_rl.config.validators import MAX_TOKENS, FieldValueError, in_range, non_negative, one_of, positive
from core_rl.errors import ConfigError
from core_rl.interfaces import LossOutput, PolicyLoss, RejectionSampler
from core_rl.ops import AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, policy_ratio, ppo_clip_loss
from core_rl.protocol import TensorBatch

if TYPE_CHECKING:
    from core_rl.config.checks import SectionContext

__all__ = ["PPOClipConfig", "PPOClipLoss", "make_ppo_clip", "policy_ratio", "ppo_clip_loss"]

PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics")


def _greater_than_one(_inst: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 1.0:
        raise FieldValueError(attribute.name, value, "must be > 1 (or null to disable)")


@attrs.define
class PPOClipConfig:
    """``algorithm.loss`` options of ``ppo_clip`` (see the README for the formulas).

    Trust region: ``eps_clip`` (lower clip, and upper unless ``eps_clip_higher`` is set), ``c_clip``
    (dual clip bound > 1), ``importance_sampling_level`` (``token``, or ``sequence``: GSPO).
    Aggregation: ``aggregation`` (:data:`core_rl.ops.AGGREGATIONS`), ``norm_length`` (the constant of
    ``seq-mean-token-sum-norm``; default ``rollout.sampling.max_new_tokens``). Regularisers:
    ``kl_coef``/``kl_estimator`` (``kl_coef > 0`` builds a reference model), ``entropy_coef``.
    Off-policy: ``use_decoupled_loss``, ``prox_logp_method``, ``off_policy_mask_threshold``,
    ``use_sapo_loss``/``sapo_tau_pos``/``sapo_tau_neg``, ``m2_threshold``.
    """

    eps_clip: float = attrs.field(default=0.2, validator=in_range(0.0, 1.0, low_open=True))
    eps_clip_higher: float | None = attrs.field(default=None, validator=positive())
    c_clip: float | None = attrs.field(default=None, validator=_greater_than_one)
    importance_sampling_level: str = attrs.field(default="token", validator=one_of(IMPORTANCE_SAMPLING_LEVELS))
    aggregation: str = attrs.field(default="token-mean", validator=one_of(AGGREGATIONS))
    norm_length: int | None = attrs.field(
        default=None, validator=in_range(1, MAX_TOKENS), metadata=default_from("rollout.sampling.max_new_tokens")
    )
    kl_coef: float = attrs.field(default=0.0, validator=non_negative())
    kl_estimator: str = attrs.field(default="k3", validator=one_of(KL_ESTIMATORS))
    entropy_coef: float = attrs.field(default=0.0, validator=non_negative())
    use_decoupled_loss: bool = False
    prox_logp_method: str = attrs.field(default="recompute", validator=one_of(PROX_LOGP_METHODS))
    off_policy_mask_threshold: float | None = attrs.field(default=None, validator=non_negative())
    use_sapo_loss: bool = False
    sapo_tau_pos: float = attrs.field(default=1.0, validator=positive())
    sapo_tau_neg: float = attrs.field(default=1.05, validator=positive())
    m2_threshold: float | None = attrs.field(default=None, validator=positive())

    def __attrs_post_init__(self) -> None:
        if self.eps_clip_higher is not None and self.eps_clip_higher < self.eps_clip:
            raise FieldValueError(
                "eps_clip_higher", self.eps_clip_higher, f"must be >= eps_clip ({self.eps_clip}) or null"
            )
        if self.prox_logp_method != "recompute" and not self.use_decoupled_loss:
            raise FieldValueError(
                "prox_logp_method", self.prox_logp_method, "applies only with use_decoupled_loss: true"
            )
        if self.use_sapo_loss:
            for name in ("use_decoupled_loss", "c_clip", "eps_clip_higher"):
                if getattr(self, name) not in (None, False):
                    raise FieldValueError(name, getattr(self, name), "cannot be combined with use_sapo_loss: true")
        if self.m2_threshold is not None and not (self.use_decoupled_loss and self.prox_logp_method != "loglinear"):
            raise FieldValueError(
                "m2_threshold",
                self.m2_threshold,
                "needs use_decoupled_loss: true with prox_logp_method 'recompute' or 'metrics' "
                "(M2PO compares behaviour and recomputed proximal log-probs before the update)",
            )

    def check_config(self, context: SectionContext) -> list[str]:
        """Problems with the rest of the run: rejection sampling acts on the decoupled loss's
        importance weight; ``recompute_logprob`` contradicts the log-linear proximal policy."""
        problems = []
        run, path = context.run, context.path
        sampler = run.algorithm.rejection_sampling
        if sampler is not None and not self.use_decoupled_loss:
            problems.append(
                f"algorithm.rejection_sampling: {sampler.name!r} acts on the decoupled loss's importance weight; "
                f"set {path}.use_decoupled_loss: true"
            )
        if run.algorithm.recompute_logprob and self.use_decoupled_loss and self.prox_logp_method == "loglinear":
            problems.append(
                f"algorithm.recompute_logprob: true contradicts {path}.prox_logp_method: loglinear, which "
                "approximates the proximal policy precisely to skip that forward pass"
            )
        return problems


class PPOClipLoss(PolicyLoss):
    """Per-token loss (see the README for every term)::

        rho_t  = pi(y_t) / pi_anchor(y_t)      token level, or the GSPO sequence ratio at sequence level;
                                               pi_anchor = pi_prox (decoupled) or pi_old
        l_t    = ppo_clip_loss(rho_t, A_t)     or sapo_loss(rho_t, A_t) with use_sapo_loss
        l_t    = l_t * w_t                     decoupled: w_t = pi_prox / pi_behave (after rejection sampling)
        l_t    = l_t + kl_coef * KL_est(pi, pi_ref) - entropy_coef * H_t
        l_t    = l_t * keep_t * mask_t         keep: rejection sampling, off-policy sequence masking

    Token metrics (0 off the response): ``ratio``, ``ratio_max``, ``clipped``, ``dual_clipped``,
    ``sapo_gate``, ``approx_kl`` (k3 estimate of KL(pi_anchor || pi)), ``kl``; with the decoupled
    loss ``behave_weight``, ``behave_weight_max``, ``kl_behave_prox``, ``kl_behave_current``,
    ``rejected``, ``clamped``, ``prox_loglinear_abs_error`` (``metrics`` method);
    ``off_policy_masked``.
    """

    def __init__(self, config: PPOClipConfig | None = None) -> None:
        self.config = config if config is not None else PPOClipConfig()
        cfg = self.config
        self.eps_low = cfg.eps_clip
        self.eps_high = cfg.eps_clip_higher if cfg.eps_clip_higher is not None else cfg.eps_clip
        self.requires_reference = cfg.kl_coef > 0
        self.requires_recompute = cfg.use_decoupled_loss and cfg.prox_logp_method != "loglinear"
        self.entropy_grad = cfg.entropy_coef > 0  # otherwise the entropy is a metric only
        self.sampler: RejectionSampler | None = None

    def set_rejection_sampler(self, sampler: RejectionSampler | None) -> None:
        if sampler is not None and not self.config.use_decoupled_loss:
            raise ConfigError(
                [
                    "algorithm.rejection_sampling: acts on the decoupled loss's importance weight; "
                    "set algorithm.loss.use_decoupled_loss: true"
                ]
            )
        self.sampler = sampler

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:
        return ops.aggregation_weights(response_mask, self.config.aggregation, norm_length=self.config.norm_length)

    def prepare(self, batch: TensorBatch) -> dict[str, float]:
        """M2PO (``m2_threshold``): drop tokens from ``loss_mask`` by the whole batch's second moment
        of ``log pi_behave - log pi_prox`` (:func:`core_rl.ops.m2po_mask`)."""
        if self.config.m2_threshold is None:
            return {}
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
        advantages = batch["advantages"].to(logprobs.dtype)
        old = batch["old_logprobs"].to(logprobs.dtype)
        behave = batch.get("behave_logprobs", old).to(logprobs.dtype)
        metrics: dict[str, torch.Tensor] = {}

        anchor = self._proximal(batch, logprobs, behave, metrics) if cfg.use_decoupled_loss else old
        ratio = torch.exp(ops.importance_log_ratio(logprobs, anchor, mask, cfg.importance_sampling_level))
        if cfg.use_sapo_loss:
            loss, gate = ops.sapo_loss(ratio, advantages, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg)
            metrics["sapo_gate"] = gate
        else:
            loss, clipped, dual_clipped = ppo_clip_loss(
                ratio, advantages, eps_low=self.eps_low, eps_high=self.eps_high, c_clip=cfg.c_clip
            )
            metrics["clipped"] = clipped.to(mask.dtype)
            if cfg.c_clip is not None:
                metrics["dual_clipped"] = dual_clipped.to(mask.dtype)
        metrics["ratio"] = ratio.detach()
        metrics["ratio_max"] = ratio.detach()
        metrics["approx_kl"] = ops.kl_estimate(anchor, logprobs.detach(), "k3")

        keep = on
        if cfg.use_decoupled_loss:
            weight, keep = self._behaviour_weight(anchor, behave, mask, keep, metrics)
            loss = loss * weight
            metrics["kl_behave_current"] = ops.kl_estimate(behave, logprobs.detach(), "k3")
        if cfg.off_policy_mask_threshold is not None:
            kept = ops.off_policy_sequence_mask(logprobs, behave, advantages, mask, cfg.off_policy_mask_threshold)
            metrics["off_policy_masked"] = (on & ~kept).to(mask.dtype)
            keep = keep & kept
        if cfg.kl_coef > 0:
            if "ref_logprobs" not in batch:
                raise KeyError("ppo_clip with kl_coef > 0 needs 'ref_logprobs' in the batch (a reference model)")
            kl = ops.kl_estimate(logprobs, batch["ref_logprobs"].to(logprobs.dtype), cfg.kl_estimator)
            loss = loss + cfg.kl_coef * kl
            metrics["kl"] = kl.detach()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * entropy
        loss = torch.where(keep, loss, torch.zeros_like(loss)) * mask
        return LossOutput(per_token_loss=loss, token_metrics={k: v * mask for k, v in metrics.items()})

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


def make_ppo_clip(config: PPOClipConfig) -> PPOClipLoss:
    return PPOClipLoss(config)
