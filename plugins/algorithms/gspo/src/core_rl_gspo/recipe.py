"""The ``gspo`` recipe (Zheng et al. 2025, Group Sequence Policy Optimization): GRPO's group-normalised
advantages with the clipped loss on the *sequence* importance ratio ``s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)``
(``ppo_clip`` with ``importance_sampling_level: sequence``, in GSPO-token's stop-gradient form).

Its settings follow the paper: a narrow clip range (3e-4 below, 4e-4 above), each sequence's token
losses averaged before the batch mean (``seq-mean-token-mean``: GSPO-token's gradient is then
GSPO's), the rollout batch cut into 4 minibatches, and old log-probs recomputed by the train engine
(the inference engine's log-probs differ from the trainer's by more than the clip range).
"""

from __future__ import annotations

import copy
from typing import Any

from core_rl.interfaces import AlgorithmRecipe

GSPO_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "grpo"},
        "loss": {
            "name": "ppo_clip",
            "importance_sampling_level": "sequence",
            "eps_clip": 3.0e-4,
            "eps_clip_higher": 4.0e-4,
            "aggregation": "seq-mean-token-mean",
        },
        "filters": [],
        "ppo_n_minibatches": 4,
        "recompute_logprob": True,
    }
}


def gspo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults=copy.deepcopy(GSPO_DEFAULTS),
        description="GSPO: sequence-level importance ratios and clipping, GRPO advantages",
    )
