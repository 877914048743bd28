"""Configuration checks of Ulysses sequence parallelism (:mod:`core_rl_train_kit.ulysses`), torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core_rl.config.checks import EnvironmentContext, SectionContext

#: attention implementations that run under Ulysses (flex attention builds block masks of its own)
ATTENTION = ("sdpa", "eager", "sdpa_float32", "flash_attention_2", "flash_attention_3")


def sequence_parallel_problems(
    context: SectionContext, size: int, attn_implementation: str | None, *, compile: bool
) -> list[str]:
    """An engine section's ``sequence_parallel_size`` against its other settings (``auto`` and
    ``None`` attention resolve to one of :data:`ATTENTION`)."""
    if size == 1:
        return []
    key = context.key("sequence_parallel_size")
    problems = []
    if compile:
        problems.append(
            f"{context.key('compile')}: true with {key}: {size}, an untested combination (attention's "
            "all-to-alls inside a compiled graph); set compile: false or sequence_parallel_size: 1"
        )
    if attn_implementation not in (None, "auto", *ATTENTION):
        problems.append(
            f"{key}: {size} runs attention as one of {', '.join(ATTENTION)}, not {attn_implementation}; "
            f"set {context.key('attn_implementation')}"
        )
    return problems


def key_value_heads_problems(context: EnvironmentContext, size: int) -> list[str]:
    """``size`` against the key/value heads in the role's model ``config.json`` (each rank of a group
    attends with ``1/size`` of them)."""
    _role, section = context.role_section()
    if size == 1 or section is None:
        return []
    config_file = Path(section.model_path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return []  # a hub id or an unreadable directory: the preflight and the build say so
    config = config.get("text_config", config)
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    if isinstance(heads, int) and heads % size:
        return [
            f"{context.key('sequence_parallel_size')}: {size} must divide the model's key/value heads ({heads}, "
            f"{config_file}); choose a divisor of {heads}"
        ]
    return []
