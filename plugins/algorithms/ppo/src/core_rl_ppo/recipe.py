"""The recipes of core-rl-ppo: ``ppo`` (a critic, GAE, the clipped surrogate) and ``distill``
(on-policy distillation from a teacher alone)."""

from __future__ import annotations

import copy
from typing import Any

from core_rl.interfaces import AlgorithmRecipe

#: PPO (Schulman et al. 2017; Ouyang et al. 2022): GAE on a critic initialised from the policy's
#: model, advantages whitened over the batch, the clipped surrogate of core-rl-grpo's ``ppo_clip``.
PPO_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "gae"},
        "loss": {"name": "ppo_clip"},
        "filters": [],
        "adv_norm": {"mean_level": "batch", "std_level": "batch"},
    },
    "critic": {"model_path": "${oc.select:actor.model_path,''}"},
}

#: On-policy distillation (Agarwal et al. 2024): the policy minimises the reverse KL to the teacher
#: on its own samples; the RL loss is off (``teacher.rl_coef: 0``). Set ``teacher.model_path``.
DISTILL_DEFAULTS: dict[str, Any] = {
    "algorithm": {"advantage": {"name": "grpo"}, "loss": {"name": "ppo_clip"}, "filters": []},
    "teacher": {"rl_coef": 0.0, "distill_coef": 1.0},
}


def ppo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults=copy.deepcopy(PPO_DEFAULTS),
        description="PPO: a critic, GAE advantages, PPO clipped loss",
        # GAE's returns are whitened over the batch; another estimator keeps its own normalisation
        depends_on={"algorithm.adv_norm": ("algorithm.advantage.name",)},
    )


def distill_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults=copy.deepcopy(DISTILL_DEFAULTS),
        description="On-policy distillation: reverse KL to a teacher on the policy's own samples",
    )
