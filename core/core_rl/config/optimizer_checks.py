"""Checks of a trained role's ``optimizer`` section (:class:`~core_rl.config.model_sections.OptimizerConfig`)
run when the configuration loads: keys that do not apply to the chosen optimizer, Muon with LoRA,
and the class an ``adafactor`` or ``class`` optimizer builds
(:func:`core_rl.config.optimizer_class.optimizer_class_problems`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from core_rl.config.model_sections import OptimizerConfig

if TYPE_CHECKING:
    from core_rl.config.schema import RunConfig

#: the optimizers each key applies to (keys not listed apply to every optimizer)
APPLIES_TO: dict[str, tuple[str, ...]] = {
    "betas": ("adamw", "muon"),
    "eps": ("adamw", "muon"),
    "implementation": ("adamw", "muon"),
    "momentum": ("sgd",),
    "muon_lr": ("muon",),
    "muon_momentum": ("muon",),
    "class_path": ("class",),
    "kwargs": ("adafactor", "class"),
}


def _default(field: attrs.Attribute[Any]) -> Any:
    default = field.default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[misc]


def misapplied_keys(config: OptimizerConfig) -> list[str]:
    """The keys set to something else than their default that do not apply to ``config.name``."""
    fields = attrs.fields_dict(OptimizerConfig)
    changed = []
    for key, names in APPLIES_TO.items():
        value = getattr(config, key)
        default = _default(fields[key])
        if config.name not in names and (tuple(value) if key == "betas" else value) != default:
            changed.append(key)
    return changed


def section_problems(config: OptimizerConfig, path: str, *, lora: bool) -> list[str]:
    """Problems of the optimizer section at ``path`` (``actor.optimizer``); ``lora``: the role
    trains LoRA adapters."""
    problems = []
    for key in misapplied_keys(config):
        names = " and ".join(APPLIES_TO[key])
        problems.append(
            f"{path}.{key}: applies to {names} only, not to {path}.name: {config.name}; remove it "
            f"(got {getattr(config, key)!r})"
        )
    if config.name == "muon" and lora:
        role = path.rsplit(".", 1)[0]
        problems.append(
            f"{path}.name: muon orthogonalises whole weight matrices, but {role}.lora trains low-rank adapters; "
            f"use adamw, or set {role}.lora.rank: 0"
        )
    if config.name in ("adafactor", "class"):
        from core_rl.config.optimizer_class import optimizer_class_problems

        problems += optimizer_class_problems(config, path)
    return problems


def optimizer_problems(cfg: RunConfig) -> list[str]:
    """:func:`section_problems` of the trained roles' optimizers (``actor``, and ``critic`` when present)."""
    sections: list[tuple[str, Any]] = [("actor", cfg.actor)]
    if cfg.critic is not None:
        sections.append(("critic", cfg.critic))
    return [
        problem
        for role, section in sections
        for problem in section_problems(section.optimizer, f"{role}.optimizer", lora=section.lora.enabled)
    ]
