"""The ``gspo`` recipe (Zheng et al. 2025, Group Sequence Policy Optimization): GRPO's group-normalised
advantages with the clipped loss on the *sequence* importance ratio ``s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)``
(``ppo_clip`` with ``importance_sampling_level: sequence``, in GSPO-token's stop-gradient form).

Its settings follow the paper: a narrow clip range (3e-4 below, 4e-4 above), each sequence's token
losses averaged before the batch mean (``seq-mean-token-mean``: GSPO-token's gradient is then
GSPO's), the rollout batch cut into 4 minibatches, and old log-probs recomputed by the train engine
(the inference engine's log-probs differ from the trainer's by more than the clip range).

The upper end of the clip range is chosen for the lower one: where a configuration sets another
``eps_clip`` itself (a GRPO file switched to ``algorithm.name=gspo``, say), the recipe's
``eps_clip_higher`` is left out, so clipping is symmetric at the configured ``eps_clip`` unless
``eps_clip_higher`` is set too.
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

#: the clip range's upper end is chosen for its lower end: a user's ``eps_clip`` (say 0.2 from a GRPO
#: file) drops the recipe's 4e-4 upper end rather than contradicting it (clipping is then symmetric)
UPPER_CLIP_FOLLOWS_LOWER = {"algorithm.loss.eps_clip_higher": ("algorithm.loss.eps_clip",)}


def gspo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults=copy.deepcopy(GSPO_DEFAULTS),
        description="GSPO: sequence-level importance ratios and clipping, GRPO advantages",
        depends_on=UPPER_CLIP_FOLLOWS_LOWER,
    )
