"""The configuration classes of core-rl-grpo's components (the ``algorithm.advantage``,
``algorithm.loss`` and ``algorithm.sample_filter`` sections), importable without torch: registering
the plugin and validating a configuration import this module only; the components themselves
(:mod:`.advantages`, :mod:`.losses`, :mod:`.filters`) import torch when a run builds them."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
from core_rl.config.checks import SectionContext, group_size_problems
from core_rl.config.kl_reward import KLInRewardConfig
from core_rl.config.schema import default_from
from core_rl.config.validators import MAX_TOKENS, FieldValueError, finite, in_range, non_negative, one_of, positive
from core_rl.ops.names import (
    AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    NOISE_PREFERENCE_LOSSES,
    PREFERENCE_LOSSES,
    SMOOTHED_PREFERENCE_LOSSES,
)

__all__ = [
    "DropUniformGroupsConfig",
    "GRPOAdvantageConfig",
    "OnlineDPOAdvantageConfig",
    "PPOClipConfig",
    "RLOOAdvantageConfig",
    "ReinforcePPAdvantageConfig",
]


@attrs.define
class GRPOAdvantageConfig(KLInRewardConfig):
    """``algorithm.advantage`` options of ``grpo``.

    ``norm_std``: divide by the group's (unbiased) standard deviation; ``eps`` (in (0, 1]): added to
    it; ``leave_one_out``: baseline is the mean of the other group members instead of the group
    mean. ``allow_single_sample_groups``: accept ``rollout.sampling.n: 1``, where every advantage is
    0 (refused otherwise: nothing would train). The KL in the reward (``kl_ctl``, ``kl_estimator``,
    ``kl_target``, ``kl_horizon``: :class:`core_rl.config.kl_reward.KLInRewardConfig`) is summed
    over the response into the score before the group statistics.
    """

    #: compares the samples of each prompt's group (``algorithm.reward_shaping.aggregation``)
    group_relative: ClassVar[bool] = True
    norm_std: bool = True
    eps: float = attrs.field(default=1e-6, validator=positive(1.0))
    leave_one_out: bool = False
    allow_single_sample_groups: bool = False

    def check_config(self, context: SectionContext) -> list[str]:
        return [
            *group_size_problems(context, allowed=self.allow_single_sample_groups, option="allow_single_sample_groups"),
            *self.kl_in_reward_problems(context),
        ]


@attrs.define
class RLOOAdvantageConfig(KLInRewardConfig):
    """``algorithm.advantage`` options of ``rloo`` (the baseline is always leave-one-out).

    ``norm_std``: also divide by the group's (unbiased) standard deviation; ``eps`` (in (0, 1]):
    added to it; ``allow_single_sample_groups``: as for ``grpo``; the KL in the reward as for ``grpo``.
    """

    group_relative: ClassVar[bool] = True
    norm_std: bool = False
    eps: float = attrs.field(default=1e-6, validator=positive(1.0))
    allow_single_sample_groups: bool = False

    def check_config(self, context: SectionContext) -> list[str]:
        return [
            *group_size_problems(context, allowed=self.allow_single_sample_groups, option="allow_single_sample_groups"),
            *self.kl_in_reward_problems(context),
        ]


@attrs.define
class ReinforcePPAdvantageConfig(KLInRewardConfig):
    """``algorithm.advantage`` options of ``reinforce_pp``.

    ``group_baseline``: subtract the group mean reward first (REINFORCE++-baseline); ``gamma``: the
    discount of the outcome reward over the response tokens before it; ``eps``: added to the batch
    standard deviation. The KL in the reward (:class:`core_rl.config.kl_reward.KLInRewardConfig`)
    is a per-token reward, discounted into the returns like the outcome.
    """

    group_baseline: bool = False
    gamma: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    eps: float = attrs.field(default=1e-5, validator=positive())

    @property
    def group_relative(self) -> bool:
        """Compares the samples of each prompt's group: with ``group_baseline``."""
        return self.group_baseline


@attrs.define
class DropUniformGroupsConfig:
    """``min_std``: also drop groups whose reward standard deviation (unbiased) is <= this.

    Needs ``rollout.sampling.n >= 2``: a group of one sample is always uniform, so every sample
    would be dropped."""

    min_std: float = attrs.field(default=0.0, validator=non_negative())

    def check_config(self, context: SectionContext) -> list[str]:
        return group_size_problems(context, allowed=False, option=None)


PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics")
#: ``ppo_clip``'s ``loss_mode``: the plain clipped surrogate, Clip-Cov or KL-Cov (Cui et al. 2025)
LOSS_MODES = ("clip", "clip_cov", "kl_cov")


#: GMPO's default log-space clip bound on either side (Zhao et al. 2025; verl's GMPO examples)
GMPO_EPS = 0.4


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
    ``kl_coef``/``kl_estimator`` (``kl_coef > 0`` builds a reference model), ``entropy_coef``
    (with ``entropy_target`` set, the adaptive coefficient's start: Skywork-OR1's control, TRL's
    ``use_adaptive_entropy``; after each optimiser step it moves by ``entropy_coef_delta`` within
    ``[entropy_coef_min, entropy_coef_max]``, up when the step's mean policy entropy over response
    tokens was at most ``entropy_target`` nats, down otherwise, and the bonus applies only while that
    entropy is at most the target: :func:`core_rl.ops.adaptive_entropy_coef`; saved in checkpoints);
    ``kl_importance_weight`` (needs ``kl_coef > 0``): the KL term times the importance ratio
    ``rho_t`` (kept in the graph), DeepSeek-V3.2's unbiased estimate of the reverse-KL gradient
    from samples of the anchor policy (TRL's ``use_bias_correction_kl``; with the decoupled loss the
    anchor is the proximal policy, and the behaviour weight does not multiply the KL term). Off-policy:
    ``use_decoupled_loss``, ``prox_logp_method``, ``off_policy_mask_threshold``, ``use_sapo_loss``/
    ``sapo_tau_pos``/``sapo_tau_neg``, ``m2_threshold``. Surrogate:
    ``use_cispo_loss`` with ``cispo_eps_low``/``cispo_eps_high`` (CISPO's clipped, detached
    importance weight in place of the clip; the default ``cispo_eps_low: 1`` sets no lower bound);
    ``use_gmpo_loss`` with ``gmpo_eps_low``/``gmpo_eps_high`` (GMPO: each sequence's loss is ``-A_i``
    times the geometric mean of its token ratios, each clipped in log space to
    ``[-gmpo_eps_low, gmpo_eps_high]`` on the pessimistic side, :func:`core_rl.ops.gmpo_loss`; default
    0.4 each, the paper's and verl's range ``(e^-0.4, e^0.4)``; every loss token carries its sequence's
    loss, so ``aggregation: seq-mean-token-mean`` is the paper's mean over sequences; token-level
    options it would contradict are refused: ``_check_gmpo``).
    Auxiliary: ``positive_nll_coef`` (0: off), an SFT term ``coef * (-log pi_t)`` on every token with
    a positive advantage, aggregated like the rest of the loss (:class:`core_rl_grpo.losses.PPOClipLoss`).
    Entropy collapse: ``loss_mode`` (``clip``; ``clip_cov`` with ``clip_cov_ratio``/``clip_cov_lb``/
    ``clip_cov_ub``; ``kl_cov`` with ``kl_cov_ratio``/``ppo_kl_coef``; defaults as verl's), tokens
    chosen once per step by their covariance of log-prob and advantage (:mod:`core_rl_grpo.covariance`);
    ``top_entropy_quantile`` (in (0, 1], 1: off): only the micro-batch's highest-entropy tokens keep
    their policy-gradient term (:func:`core_rl.ops.top_quantile_mask`). ``adv_clip_low``/``adv_clip_high``
    (null: off): the loss uses ``clip(A_t, low, high)`` in place of ``A_t``, in every term.
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
    kl_importance_weight: bool = False
    entropy_coef: float = attrs.field(default=0.0, validator=non_negative())
    entropy_target: float | None = attrs.field(default=None, validator=non_negative())
    entropy_coef_min: float = attrs.field(default=0.0, validator=non_negative())
    entropy_coef_max: float = attrs.field(default=1.0, validator=non_negative())
    entropy_coef_delta: float = attrs.field(default=0.005, validator=positive())
    use_decoupled_loss: bool = False
    prox_logp_method: str = attrs.field(default="recompute", validator=one_of(PROX_LOGP_METHODS))
    off_policy_mask_threshold: float | None = attrs.field(default=None, validator=non_negative())
    use_sapo_loss: bool = False
    sapo_tau_pos: float = attrs.field(default=1.0, validator=positive())
    sapo_tau_neg: float = attrs.field(default=1.05, validator=positive())
    m2_threshold: float | None = attrs.field(default=None, validator=positive())
    use_cispo_loss: bool = False
    cispo_eps_low: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    cispo_eps_high: float = attrs.field(default=0.28, validator=non_negative())
    use_gmpo_loss: bool = False
    gmpo_eps_low: float = attrs.field(default=GMPO_EPS, validator=positive())
    gmpo_eps_high: float = attrs.field(default=GMPO_EPS, validator=positive())
    positive_nll_coef: float = attrs.field(default=0.0, validator=non_negative())
    loss_mode: str = attrs.field(default="clip", validator=one_of(LOSS_MODES))
    clip_cov_ratio: float = attrs.field(default=0.0002, validator=in_range(0.0, 1.0))
    clip_cov_lb: float = attrs.field(default=1.0, validator=finite())
    clip_cov_ub: float = attrs.field(default=5.0, validator=finite())
    kl_cov_ratio: float = attrs.field(default=0.0002, validator=in_range(0.0, 1.0))
    ppo_kl_coef: float = attrs.field(default=0.1, validator=non_negative())
    top_entropy_quantile: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0, low_open=True))
    adv_clip_low: float | None = attrs.field(default=None, validator=finite())
    adv_clip_high: float | None = attrs.field(default=None, validator=finite())

    def __attrs_post_init__(self) -> None:
        self._check_gmpo()
        self._check_loss_mode()
        if self.kl_importance_weight and self.kl_coef == 0:
            raise FieldValueError("kl_importance_weight", True, "weighs the KL term: it needs kl_coef > 0")
        self._check_adaptive_entropy()
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
        if self.use_cispo_loss:
            for name in ("use_sapo_loss", "c_clip", "eps_clip_higher"):
                if getattr(self, name) not in (None, False):
                    raise FieldValueError(
                        name, getattr(self, name), "cannot be combined with use_cispo_loss: true (it has no PPO clip)"
                    )
        if self.m2_threshold is not None and not (self.use_decoupled_loss and self.prox_logp_method != "loglinear"):
            raise FieldValueError(
                "m2_threshold",
                self.m2_threshold,
                "needs use_decoupled_loss: true with prox_logp_method 'recompute' or 'metrics' "
                "(M2PO compares behaviour and recomputed proximal log-probs before the update)",
            )

    def _check_adaptive_entropy(self) -> None:
        """The bounds and step apply only to the adaptive coefficient, which starts at
        ``entropy_coef`` inside them."""
        if self.entropy_target is None:
            for name, default in (("entropy_coef_min", 0.0), ("entropy_coef_max", 1.0), ("entropy_coef_delta", 0.005)):
                if getattr(self, name) != default:
                    raise FieldValueError(
                        name, getattr(self, name), "applies only to the adaptive coefficient: set entropy_target"
                    )
            return
        if not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            raise FieldValueError(
                "entropy_coef",
                self.entropy_coef,
                f"is the adaptive coefficient's start: it must lie in [entropy_coef_min, entropy_coef_max] = "
                f"[{self.entropy_coef_min}, {self.entropy_coef_max}]",
            )

    def _check_gmpo(self) -> None:
        """GMPO's bounds apply only with ``use_gmpo_loss``; GMPO replaces the token-level clipped
        surrogate by one value per sequence, so the options that act on that surrogate token by token
        (or would be ignored) are refused with it, each naming the key."""
        if not self.use_gmpo_loss:
            for name in ("gmpo_eps_low", "gmpo_eps_high"):
                if getattr(self, name) != GMPO_EPS:
                    raise FieldValueError(name, getattr(self, name), "applies only with use_gmpo_loss: true")
            return
        refused = {  # option: (its default, why it cannot change with GMPO)
            "use_sapo_loss": (False, "SAPO's soft gate and GMPO each replace the clipped surrogate"),
            "use_cispo_loss": (False, "CISPO's weight and GMPO each replace the clipped surrogate"),
            "importance_sampling_level": (
                "token",
                "GMPO already takes the geometric mean of the token ratios over each sequence; keep 'token'",
            ),
            "use_decoupled_loss": (False, "its behaviour weight is per token, GMPO's loss one value per sequence"),
            "c_clip": (None, "GMPO has no dual clip; its clip is gmpo_eps_low/gmpo_eps_high, in log space"),
            "eps_clip_higher": (None, "set gmpo_eps_high instead: GMPO clips the log-ratio"),
            "eps_clip": (0.2, "set gmpo_eps_low/gmpo_eps_high instead: GMPO clips the log-ratio"),
            "loss_mode": ("clip", "Clip-Cov and KL-Cov select tokens of the token-level surrogate"),
            "top_entropy_quantile": (1.0, "it drops tokens of the token-level surrogate"),
        }
        for name, (default, why) in refused.items():
            if getattr(self, name) != default:
                raise FieldValueError(name, getattr(self, name), f"cannot be combined with use_gmpo_loss: true ({why})")

    def _check_loss_mode(self) -> None:
        """Clip-Cov needs ``clip_cov_lb < clip_cov_ub``; both covariance modes replace the
        surrogate, so SAPO and CISPO are refused with them, and KL-Cov (no trust-region clip) refuses
        the clip options it would ignore."""
        low, high = self.adv_clip_low, self.adv_clip_high
        if low is not None and high is not None and not low < high:
            raise FieldValueError("adv_clip_high", high, f"must be > adv_clip_low ({low}) or null")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise FieldValueError("clip_cov_ub", self.clip_cov_ub, f"must be > clip_cov_lb ({self.clip_cov_lb})")
        if self.loss_mode == "clip":
            return
        for name in ("use_sapo_loss", "use_cispo_loss"):
            if getattr(self, name):
                raise FieldValueError(
                    name, True, f"cannot be combined with loss_mode: {self.loss_mode} (it replaces the surrogate)"
                )
        if self.loss_mode == "kl_cov":
            for name in ("c_clip", "eps_clip_higher"):
                if getattr(self, name) is not None:
                    raise FieldValueError(
                        name, getattr(self, name), "does nothing with loss_mode: kl_cov (its surrogate is unclipped)"
                    )

    def check_config(self, context: SectionContext) -> list[str]:
        """Problems with the rest of the run: ``recompute_logprob`` contradicts the log-linear
        proximal policy. (A rejection sampler, from the start or turned on by
        ``algorithm.mismatch_budget``'s ``correct``, weights either loss: the decoupled one's
        ``pi_prox / pi_behave``, the plain one's ``pi_old / pi_behave`` with ``old_logprobs``
        recomputed.)"""
        problems = []
        run, path = context.run, context.path
        if run.algorithm.recompute_logprob and self.use_decoupled_loss and self.prox_logp_method == "loglinear":
            problems.append(
                f"algorithm.recompute_logprob: true contradicts {path}.prox_logp_method: loglinear, which "
                "approximates the proximal policy precisely to skip that forward pass"
            )
        return problems


@attrs.define
class OnlineDPOAdvantageConfig:
    """``algorithm.advantage`` options of ``online_dpo`` (:mod:`core_rl_grpo.online_dpo`): the
    preference loss of each prompt's best and worst sample, ``loss_type`` one of
    :data:`core_rl.ops.names.PREFERENCE_LOSSES` (formulas: :mod:`core_rl.ops.preference`) with
    ``beta``, ``label_smoothing`` (sigmoid, robust, exo_pair; the last two need it above 0) and
    ``discopop_tau`` (discopop)."""

    loss_type: str = attrs.field(default="sigmoid", validator=one_of(PREFERENCE_LOSSES))
    beta: float = attrs.field(default=0.1, validator=positive(1e6))
    label_smoothing: float = attrs.field(default=0.0, validator=in_range(0.0, 0.5, high_open=True))
    discopop_tau: float = attrs.field(default=0.05, validator=positive(1e6))

    def __attrs_post_init__(self) -> None:
        if self.label_smoothing and self.loss_type not in SMOOTHED_PREFERENCE_LOSSES:
            raise FieldValueError(
                "label_smoothing", self.label_smoothing, f"loss_type {self.loss_type} does not read it; remove it"
            )
        if self.loss_type in NOISE_PREFERENCE_LOSSES and not self.label_smoothing:
            raise FieldValueError(
                "label_smoothing", 0.0, f"loss_type {self.loss_type} models label noise and needs it in (0, 0.5)"
            )
        if self.discopop_tau != 0.05 and self.loss_type != "discopop":
            raise FieldValueError("discopop_tau", self.discopop_tau, "only loss_type discopop reads it; remove it")

    def check_config(self, context: SectionContext) -> list[str]:
        problems = group_size_problems(context, allowed=False, option=None)
        if context.run.algorithm.adv_norm is not None:
            problems.append(
                f"algorithm.adv_norm: {context.name!r} sets each pair's advantages to its preference loss's "
                "gradient and every other sample's to 0, which normalising would change; remove adv_norm"
            )
        return problems
