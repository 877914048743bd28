"""The ``dapo`` recipe (Yu et al. 2025, Decoupled Clip and Dynamic sAmpling Policy Optimization):
GRPO's group-normalised advantages with

- clip-higher: ``eps_clip`` 0.2 below, ``eps_clip_higher`` 0.28 above (chosen for the 0.2: a
  configuration that sets another ``eps_clip`` leaves the recipe's 0.28 out unless it sets
  ``eps_clip_higher`` too);
- token-level aggregation (``token-mean``): long responses weigh by their tokens;
- dynamic sampling: groups whose rewards are all equal are dropped (``drop_uniform_groups``) and more
  prompts are drawn until ``data.batch_size`` prompts' groups remain, at most
  ``algorithm.max_num_gen_batches`` (10) generation batches per step;
- no KL penalty (the ``ppo_clip`` default).

Overlong reward shaping and the masking of truncated samples are core options every recipe has;
DAPO's values depend on the response budget, so set them for yours:
``algorithm.reward_shaping.overlong_tokens`` (DAPO: 4096 of 20480 tokens),
``overlong_penalty_factor`` (1.0), ``algorithm.mask_no_eos_with_zero``.
"""

from __future__ import annotations

import copy
from typing import Any

from core_rl.interfaces import AlgorithmRecipe

DAPO_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "grpo"},
        "loss": {"name": "ppo_clip", "eps_clip": 0.2, "eps_clip_higher": 0.28, "aggregation": "token-mean"},
        "filters": [{"name": "drop_uniform_groups"}],
        "max_num_gen_batches": 10,
    }
}


def dapo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults=copy.deepcopy(DAPO_DEFAULTS),
        description="DAPO: clip-higher, token-level loss, dynamic sampling that refills the batch",
        depends_on={"algorithm.loss.eps_clip_higher": ("algorithm.loss.eps_clip",)},
    )
