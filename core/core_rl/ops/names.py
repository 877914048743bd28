"""The option names of the shared math (what a config may choose), importable without torch.

Config classes validate against these tuples (``one_of(AGGREGATIONS)``) at registration time,
before a run imports torch; the functions of :mod:`core_rl.ops` that take these names raise on
any other.
"""

#: loss aggregations over a ``[B, T]`` mask (:func:`core_rl.ops.aggregation_weights`)
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: KL estimators k1, k2, k3 (:func:`core_rl.ops.kl_estimate`)
KL_ESTIMATORS = ("k1", "k2", "k3")
#: the level of an importance ratio: per token, or one per sequence (GSPO)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
#: how a sequence's per-token values reduce to one (:func:`core_rl.ops.sequence_reduce`)
SEQUENCE_REDUCTIONS = ("sum", "mean", "max")
#: the levels a mean or a standard deviation is taken at (:func:`core_rl.ops.normalize`)
NORM_LEVELS = ("batch", "group", "none")
#: how a reward's weighted parts become one reward: their weighted sum, or GDPO's sum of the parts
#: normalised within their groups first (:func:`core_rl.ops.normalize_then_sum`)
REWARD_AGGREGATIONS = ("sum", "normalize_then_sum")
#: per-pair preference losses on log-ratios against a reference (:func:`core_rl.ops.preference_loss`)
PREFERENCE_LOSSES = (
    "sigmoid",
    "ipo",
    "hinge",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
)
#: the preference losses that read ``label_smoothing``, and those that need it above 0 (label noise)
SMOOTHED_PREFERENCE_LOSSES = ("sigmoid", "robust", "exo_pair")
NOISE_PREFERENCE_LOSSES = ("robust", "exo_pair")
#: per-pair preference losses on the policy's length-normalised log-probs alone, no reference
#: (:func:`core_rl.ops.simpo_loss`, :func:`core_rl.ops.orpo_loss`)
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
#: critic value losses (:func:`core_rl.ops.value_loss`)
VALUE_LOSSES = ("mse", "huber")
#: the distillation losses of a ``teacher:`` section (``teacher.loss``)
DISTILL_LOSSES = ("reverse_kl", "topk_forward_kl")
#: rejection by a divergence metric (:func:`core_rl.ops.reject_by_metric`): the level it judges
#: at, what it does out of bounds, and how a sequence's tokens aggregate
REJECTION_LEVELS = IMPORTANCE_SAMPLING_LEVELS
REJECTION_ACTIONS = ("mask", "clamp")
REJECTION_AGGREGATIONS = SEQUENCE_REDUCTIONS
