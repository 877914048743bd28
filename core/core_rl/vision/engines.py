"""Which engines take vision-language models: an engine claims it with ``multimodal = True`` on its
config class (``hf``, ``fsdp``, ``deepspeed``); a run whose actor is a VLM
(:func:`~core_rl.vision.models.is_vision_language`) on an engine that does not claim it is refused
at ``config validate`` (:func:`engine_problems`), naming the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core_rl.vision.models import is_vision_language

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig
    from core_rl.plugins.host import PluginHost

#: the config-class attribute by which an engine claims it takes images
SUPPORT_ATTRIBUTE = "multimodal"


def claims_multimodal(entry: Any) -> bool:
    """Whether a registered engine (its registry entry) claims ``multimodal``."""
    return bool(getattr(entry.config_cls, SUPPORT_ATTRIBUTE, False))


def engine_problems(cfg: RunConfig, host: PluginHost) -> list[str]:
    """A problem for each engine of the run that would hold the actor's vision-language model (the
    actor's train engine, the other trained or reference roles on the same model, the rollout engine)
    without claiming ``multimodal``."""
    from core_rl.plugins.kinds import ROLLOUT_ENGINE, TRAIN_ENGINE
    from core_rl.roles.build import role_sections

    model = cfg.actor.model_path
    if not is_vision_language(model):
        return []
    problems = []
    sections: list[tuple[str, Any]] = [("actor", cfg.actor)]
    sections += [(role, s) for role, s in role_sections(cfg) if is_vision_language(s.model_path or model)]
    wanted: list[tuple[str, Any, str]] = [
        (f"{role}.engine.name", host.registries[TRAIN_ENGINE.key].get(s.engine.name), "train") for role, s in sections
    ]
    wanted.append(("rollout.engine.name", host.registries[ROLLOUT_ENGINE.key].get(cfg.rollout.engine.name), "rollout"))
    for key, entry, kind in wanted:
        if entry is not None and not claims_multimodal(entry):
            instead = "fsdp or deepspeed" if kind == "train" else "hf"
            problems.append(
                f"{key}: {kind} engine {entry.name!r} (distribution {entry.distribution}) does not take images, "
                f"but actor.model_path {model} is a vision-language model (its config.json has a vision_config); "
                f"set {key} to {instead} (engines claiming multimodal: see core-rl plugins)"
            )
    return problems
