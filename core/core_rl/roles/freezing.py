"""Training part of a model (``<role>.freeze``): parameters whose name matches any of the listed
regular expressions (``re.search`` on the names of the Hugging Face model, e.g.
``model.embed_tokens.weight``, ``model.layers.0.mlp.up_proj.weight``) keep their starting values.

A frozen parameter gets no gradient, no optimizer state and no share of the gradient-norm clip;
it is still part of every weight sync, checkpoint and export, unchanged. Freezing is applied by the
train engine when it builds the model (:func:`freeze_parameters`); an engine declares that it does
with ``freezes_parameters = True`` on its config class (``fsdp``, ``deepspeed``), and the switch on
another engine is refused at ``config validate`` (:func:`engine_problems`). Before the run,
:func:`freeze_problems` checks the patterns against the model's parameter names (the model built
on the ``meta`` device: no memory, no weight read): a pattern that matches nothing is a typo, and
freezing every parameter leaves nothing to train. With LoRA the base model is frozen already and
only the adapters train, so the two are not combined.

Examples: ``[embed_tokens]`` (the input embeddings, and a head tied to them), ``['layers\\.([0-9]|1[0-1])\\.']``
(the first twelve decoder layers), ``[vision]`` (a vision tower).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from core_rl.config.schema import RunConfig
    from core_rl.plugins.host import PluginHost

#: the config-class attribute by which a train engine declares it applies ``freeze``
SUPPORT_ATTRIBUTE = "freezes_parameters"


def frozen_names(names: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The names any of ``patterns`` finds (``re.search``), in ``names``' order."""
    compiled = [re.compile(p) for p in patterns]
    return [name for name in names if any(c.search(name) for c in compiled)]


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Turn off gradients of ``model``'s parameters that ``patterns`` find; return their names."""
    if not patterns:
        return []
    names = dict(model.named_parameters())
    frozen = frozen_names(list(names), patterns)
    for name in frozen:
        names[name].requires_grad_(False)
    return frozen


def freeze_problems(model: nn.Module, patterns: Sequence[str], key: str) -> list[str]:
    """``key`` (``actor.freeze``) against ``model``'s parameter names: each pattern that finds
    none (with some names to choose from), or all of them found."""
    names = [name for name, _ in model.named_parameters()]
    problems = []
    for i, pattern in enumerate(patterns):
        if not frozen_names(names, [pattern]):
            shown = ", ".join(names[:4])
            problems.append(
                f"{key}[{i}]: {pattern!r} matches no parameter of the model (names look like {shown}, ...); "
                "patterns are regular expressions searched in those names"
            )
    if patterns and not problems and len(frozen_names(names, patterns)) == len(names):
        problems.append(f"{key}: {list(patterns)} freeze every parameter, which leaves nothing to train")
    return problems


def engine_problems(cfg: RunConfig, host: PluginHost) -> list[str]:
    """``<role>.freeze`` on a trained role whose train engine does not apply it, or with LoRA."""
    from core_rl.plugins.kinds import TRAIN_ENGINE

    problems = []
    sections: list[tuple[str, Any]] = [("actor", cfg.actor)]
    if cfg.critic is not None:
        sections.append(("critic", cfg.critic))
    for role, section in sections:
        if not section.freeze:
            continue
        if section.lora.enabled:
            problems.append(
                f"{role}.freeze: with {role}.lora the base model is frozen already and only the adapters train; "
                f"remove {role}.freeze or set {role}.lora.rank: 0"
            )
        entry = host.registries[TRAIN_ENGINE.key].get(section.engine.name)
        if entry is not None and not getattr(entry.config_cls, SUPPORT_ATTRIBUTE, False):
            problems.append(
                f"{role}.freeze: train engine {entry.name!r} (distribution {entry.distribution}) does not freeze "
                f"parameters (its config class does not set {SUPPORT_ATTRIBUTE} = True); set {role}.engine.name to "
                "fsdp or deepspeed, or remove the key"
            )
    return problems
