"""The algorithm math every plugin shares, as small pure tensor functions (no formula is written
twice): masked and group statistics and normalisation, loss aggregation, KL estimators, importance
ratios (token and sequence level), surrogate losses and off-policy masks, the token selections
against entropy collapse (Clip-Cov, KL-Cov, the high-entropy quantile), importance-weight
rejection, reward shaping, and value-function math (GAE, clipped value loss, KL control,
distillation).

All ``[B, T]`` arguments follow :mod:`core_rl.protocol`'s convention (position ``t`` describes token
``t``; ``mask`` is a response or loss mask). Everything is vectorised over samples and groups.

The names are imported lazily (on first access), so ``core_rl.ops.names`` (the option names
config classes validate against) imports without torch.
"""

from __future__ import annotations

from core_rl.plugins.lazy_exports import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.ops.aggregation": ("aggregation_weights",),
        "core_rl.ops.entropy_control": (
            "adaptive_entropy_coef",
            "clip_cov_loss",
            "clip_cov_select",
            "kl_cov_loss",
            "kl_cov_select",
            "selection_count",
            "token_covariance",
            "top_quantile_mask",
        ),
        "core_rl.ops.importance": ("behaviour_log_ratio", "divergence_metric", "reject_by_metric"),
        "core_rl.ops.kl": (
            "KL_CAP",
            "adaptive_kl_coef",
            "kl_estimate",
            "reverse_kl_distill_loss",
            "topk_forward_kl_loss",
        ),
        "core_rl.ops.mismatch": (
            "MISMATCH_METRICS",
            "means_of_sums",
            "mismatch_means",
            "mismatch_sums",
            "mismatch_values",
        ),
        "core_rl.ops.names": (
            "AGGREGATIONS",
            "IMPORTANCE_SAMPLING_LEVELS",
            "KL_ESTIMATORS",
            "NOISE_PREFERENCE_LOSSES",
            "NORM_LEVELS",
            "PREFERENCE_LOSSES",
            "REFERENCE_FREE_LOSSES",
            "REJECTION_ACTIONS",
            "REJECTION_AGGREGATIONS",
            "REJECTION_LEVELS",
            "SEQUENCE_REDUCTIONS",
            "SMOOTHED_PREFERENCE_LOSSES",
            "VALUE_LOSSES",
        ),
        "core_rl.ops.preference": (
            "LOG_ODDS_MAX_LOGPROB",
            "bradley_terry_loss",
            "kto_kl_baseline",
            "kto_loss",
            "log_odds",
            "mean_token_logprob",
            "orpo_loss",
            "preference_loss",
            "preference_metrics",
            "sequence_logprob",
            "simpo_loss",
        ),
        "core_rl.ops.ratios": (
            "MAX_LOG_RATIO",
            "clamp_log_ratio",
            "gspo_token_log_ratio",
            "importance_log_ratio",
            "policy_ratio",
            "sequence_log_ratio",
            "sequence_reduce",
        ),
        "core_rl.ops.rewards": (
            "discounted_outcome_returns",
            "normalize_then_sum",
            "overlong_penalty",
            "scale_rewards",
        ),
        "core_rl.ops.stats": (
            "group_ids_to_dense",
            "group_is_uniform",
            "group_mean_std",
            "masked_mean",
            "masked_sum",
            "masked_whiten",
            "normalize",
            "segment_sum",
        ),
        "core_rl.ops.surrogates": (
            "cispo_loss",
            "gmpo_loss",
            "loglinear_proximal_logprobs",
            "m2po_mask",
            "off_policy_sequence_mask",
            "ppo_clip_loss",
            "sapo_loss",
        ),
        "core_rl.ops.values": ("gae_advantages", "huber", "last_token_mask", "token_level_rewards", "value_loss"),
    },
)
