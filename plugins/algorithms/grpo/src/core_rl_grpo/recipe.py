"""The ``grpo`` algorithm recipe (Shao et al. 2024, DeepSeekMath): group-normalised outcome advantages
with the PPO clipped loss and no value model."""

from __future__ import annotations

from typing import Any

from core_rl.interfaces import AlgorithmRecipe

#: Merged *under* the user's configuration. Only component names are set: every option's GRPO
#: default is the default of the component's own config class (``grpo``: norm_std true, eps 1e-6;
#: ``ppo_clip``: eps_clip 0.2, token-mean, no KL penalty, no entropy bonus). Options here would be
#: merged into a section the user points at another component (e.g. ``loss: {name: my_loss}``)
#: and rejected there as unknown keys.
GRPO_DEFAULTS: dict[str, Any] = {
    "algorithm": {
        "advantage": {"name": "grpo"},
        "loss": {"name": "ppo_clip"},
        "filters": [],
    }
}


def grpo_recipe() -> AlgorithmRecipe:
    return AlgorithmRecipe(
        defaults={"algorithm": {k: v.copy() for k, v in GRPO_DEFAULTS["algorithm"].items()}},
        description="GRPO: group-relative advantages + PPO clipped loss, no critic",
    )
