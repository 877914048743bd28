"""The algorithm recipes of core-rl-grpo: ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp`` and
``online_dpo``.

A recipe's defaults are merged *under* the user's configuration; a section the user points at
another component drops the recipe's options for it. Options not set here are the defaults of each
component's own config class (``grpo``: norm_std true, eps 1e-6; ``ppo_clip``: eps_clip 0.2,
token-mean, no KL penalty, no entropy bonus).
"""

from __future__ import annotations

import copy
from typing import Any

from core_rl.interfaces import AlgorithmRecipe

#: GRPO (Shao et al. 2024, DeepSeekMath): group-normalised outcome advantages, PPO clipped loss.
GRPO_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "grpo"},
        "loss": {"name": "ppo_clip"},
        "filters": [],
    }
}

#: Dr. GRPO (Liu et al. 2025): no std normalisation, token sums over a constant length (the
#: response budget ``rollout.sampling.max_new_tokens``, the default of ``norm_length``).
DR_GRPO_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "grpo", "norm_std": False},
        "loss": {"name": "ppo_clip", "aggregation": "seq-mean-token-sum-norm"},
        "filters": [],
    }
}

#: RLOO (Kool et al. 2019; Ahmadian et al. 2024): leave-one-out baseline, PPO clipped loss.
RLOO_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "rloo"},
        "loss": {"name": "ppo_clip"},
        "filters": [],
    }
}

#: REINFORCE++ (Hu 2025): batch-whitened returns, PPO clipped loss over token means.
REINFORCE_PP_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "reinforce_pp"},
        "loss": {"name": "ppo_clip"},
        "filters": [],
    }
}


#: Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"): each
#: prompt's best and worst samples by reward as a preference pair, the DPO gradient through a
#: policy-gradient step at ratio 1 (:mod:`core_rl_grpo.online_dpo`).
ONLINE_DPO_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "online_dpo"},
        "loss": {"name": "ppo_clip", "aggregation": "seq-mean-token-sum"},
        "filters": [],
        "ppo_epochs": 1,
        "ppo_n_minibatches": 1,
    }
}


def _recipe(defaults: dict[str, Any], description: str) -> AlgorithmRecipe:
    return AlgorithmRecipe(defaults=copy.deepcopy(defaults), description=description)


def grpo_recipe() -> AlgorithmRecipe:
    return _recipe(GRPO_DEFAULTS, "GRPO: group-relative advantages + PPO clipped loss, no critic")


def dr_grpo_recipe() -> AlgorithmRecipe:
    return _recipe(DR_GRPO_DEFAULTS, "Dr. GRPO: unnormalised group advantages, token sums over the response budget")


def rloo_recipe() -> AlgorithmRecipe:
    return _recipe(RLOO_DEFAULTS, "RLOO: leave-one-out group baseline + PPO clipped loss")


def online_dpo_recipe() -> AlgorithmRecipe:
    return _recipe(ONLINE_DPO_DEFAULTS, "Online DPO: each prompt's best and worst samples as a DPO pair, sampled fresh")


def reinforce_pp_recipe() -> AlgorithmRecipe:
    return _recipe(REINFORCE_PP_DEFAULTS, "REINFORCE++: batch-whitened outcome returns + PPO clipped loss")
