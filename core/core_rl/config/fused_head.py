"""What a role's ``fused_head: true`` asks of its model (:mod:`core_rl_train_kit.fused_head`
computes log-probs from the last hidden states and the head's weight, so the model's forward must
hand the head's output on unchanged, and the head must be its plain weight).

Engines that honour the setting say so (``fused_head = True`` on their config class; the core
refuses it for any other, :func:`core_rl.roles.build.role_problems`) and check the role's model with
:func:`fused_head_problems`. Imports neither torch nor transformers: config checks run before
either is loaded (``core-rl config validate``); the model is read from its ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core_rl.config.checks import SectionContext

#: model-config keys that transform the logits after the head inside the model's forward, with
#: their neutral values (Gemma 2/3's soft-capping, Cohere's logit scale, Granite's scaling,
#: Falcon-H1's multiplier); a transform not listed is caught at the first forward
#: (:func:`core_rl_train_kit.fused_head.check_handed_on`)
LOGIT_TRANSFORMS: dict[str, Any] = {
    "final_logit_softcapping": None,
    "logit_scale": None,
    "logits_scaling": 1.0,
    "lm_head_multiplier": 1.0,
}


def logit_transform(model_config: Any) -> str | None:
    """``"name=value"`` of the first :data:`LOGIT_TRANSFORMS` key the model config sets to a
    non-neutral value (a mapping or an object with attributes; a nested ``text_config`` too)."""
    for config in (model_config, _get(model_config, "text_config", None)):
        if config is None:
            continue
        for name, neutral in LOGIT_TRANSFORMS.items():
            value = _get(config, name, neutral)
            if value != neutral:
                return f"{name}={value!r}"
    return None


def _get(config: Any, name: str, default: Any) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def fused_head_problems(context: SectionContext) -> list[str]:
    """For an engine that honours ``fused_head``: the role's setting against its model (a logit
    transform in ``config.json``, LoRA on the head)."""
    role, section = context.role_section()
    if section is None or not getattr(section, "fused_head", False):
        return []
    key = f"{role}.fused_head"
    problems = []
    targets = section.lora.target_modules if section.lora.enabled else []
    if any(t == "lm_head" or t.endswith(".lm_head") for t in targets):
        problems.append(
            f"{key}: {role}.lora.target_modules adapts lm_head, and the fused head multiplies by the head's "
            "own weight only; leave lm_head out of the adapters or set fused_head: false"
        )
    config_file = Path(section.model_path) / "config.json"
    try:
        model_config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return problems  # a hub id or an unreadable directory: the preflight and the build say so
    transform = logit_transform(model_config)
    if transform is not None:
        problems.append(
            f"{key}: the model ({config_file}) sets {transform}, which transforms the logits after the head "
            "and a fused head would skip; set fused_head: false"
        )
    return problems
