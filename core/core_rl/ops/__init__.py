"""The algorithm math every plugin shares, as small pure tensor functions (no formula is written
twice): masked and group statistics and normalisation, loss aggregation, KL estimators, importance
ratios (token and sequence level), surrogate losses and off-policy masks, importance-weight
rejection, reward shaping, and value-function math (GAE, clipped value loss, KL control,
distillation).

All ``[B, T]`` arguments follow :mod:`core_rl.protocol`'s convention (position ``t`` describes token
``t``; ``mask`` is a response or loss mask). Everything is vectorised over samples and groups.
"""

from core_rl.ops.aggregation import AGGREGATIONS, aggregation_weights
from core_rl.ops.importance import (
    REJECTION_ACTIONS,
    REJECTION_AGGREGATIONS,
    REJECTION_LEVELS,
    behaviour_log_ratio,
    divergence_metric,
    reject_by_metric,
)
from core_rl.ops.kl import KL_CAP, KL_ESTIMATORS, adaptive_kl_coef, kl_estimate, reverse_kl_distill_loss
from core_rl.ops.preference import (
    PREFERENCE_LOSSES,
    bradley_terry_loss,
    preference_loss,
    preference_metrics,
    sequence_logprob,
)
from core_rl.ops.ratios import (
    IMPORTANCE_SAMPLING_LEVELS,
    MAX_LOG_RATIO,
    SEQUENCE_REDUCTIONS,
    clamp_log_ratio,
    gspo_token_log_ratio,
    importance_log_ratio,
    policy_ratio,
    sequence_log_ratio,
    sequence_reduce,
)
from core_rl.ops.rewards import discounted_outcome_returns, overlong_penalty, scale_rewards
from core_rl.ops.stats import (
    NORM_LEVELS,
    group_ids_to_dense,
    group_is_uniform,
    group_mean_std,
    masked_mean,
    masked_sum,
    masked_whiten,
    normalize,
    segment_sum,
)
from core_rl.ops.surrogates import (
    loglinear_proximal_logprobs,
    m2po_mask,
    off_policy_sequence_mask,
    ppo_clip_loss,
    sapo_loss,
)
from core_rl.ops.values import VALUE_LOSSES, gae_advantages, huber, last_token_mask, token_level_rewards, value_loss

__all__ = [
    "AGGREGATIONS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "KL_CAP",
    "KL_ESTIMATORS",
    "MAX_LOG_RATIO",
    "NORM_LEVELS",
    "PREFERENCE_LOSSES",
    "REJECTION_ACTIONS",
    "REJECTION_AGGREGATIONS",
    "REJECTION_LEVELS",
    "SEQUENCE_REDUCTIONS",
    "VALUE_LOSSES",
    "adaptive_kl_coef",
    "aggregation_weights",
    "behaviour_log_ratio",
    "bradley_terry_loss",
    "clamp_log_ratio",
    "discounted_outcome_returns",
    "divergence_metric",
    "gae_advantages",
    "group_ids_to_dense",
    "group_is_uniform",
    "group_mean_std",
    "gspo_token_log_ratio",
    "huber",
    "importance_log_ratio",
    "kl_estimate",
    "last_token_mask",
    "loglinear_proximal_logprobs",
    "m2po_mask",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "normalize",
    "off_policy_sequence_mask",
    "overlong_penalty",
    "policy_ratio",
    "ppo_clip_loss",
    "preference_loss",
    "preference_metrics",
    "reject_by_metric",
    "reverse_kl_distill_loss",
    "sapo_loss",
    "scale_rewards",
    "segment_sum",
    "sequence_log_ratio",
    "sequence_logprob",
    "sequence_reduce",
    "token_level_rewards",
    "value_loss",
]
