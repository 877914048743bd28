"""Overriding keys of a model's ``config.json`` for a run (``<role>.model_overrides``), e.g. RoPE
scaling for a longer context (``rope_scaling: {rope_type: yarn, factor: 4.0}``,
``max_position_embeddings: 131072``), a sliding window or a dropout rate.

Before anything loads the model, :func:`apply_model_overrides` makes a directory for each role
with overrides, ``<run>/model_overrides/<role>``: the model directory's files linked (no weight is
copied) and its ``config.json`` with each override's key replaced whole (a mapping value is not
merged with the old one). The role's ``model_path`` then names that directory, so every engine that
loads the role's model (train engines, and the rollout engine and inference servers for the
policy) reads the same configuration, and an export carries it. The run's ``config.yaml`` keeps
the original path, noting the derived one. A key must be one the model's configuration class
knows, so a misspelt one is an error rather than a setting nothing reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core_rl.config.derived import record
from core_rl.config.derived_key import Derived
from core_rl.config.schema import RunConfig
from core_rl.roles.build import role_sections
from core_rl.roles.derived_dirs import STAMP, made_once


def config_problems(
    model_path: str, overrides: Mapping[str, Any], key: str, *, trust_remote_code: bool = False
) -> list[str]:
    """The overrides of section ``key`` that ``model_path``'s configuration class does not know,
    each a problem naming the key and the model type (a configuration class the directory ships
    is read only with ``trust_remote_code``, the section's switch)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception:  # the model directory's own problems are preflight's to report
        return []
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = {}
    known = set(raw) | set(config.to_dict()) | set(getattr(config, "rope_parameters", None) or {})
    unknown = sorted(name for name in overrides if name not in known and not hasattr(config, name))
    return [
        f"{key}.model_overrides.{name}: not a setting of a {config.model_type} model's configuration "
        f"({type(config).__name__}); check the name against its config.json"
        for name in unknown
    ]


def overridden_config(model_path: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``model_path``'s ``config.json`` with each key of ``overrides`` replaced by its value."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    return {**config, **overrides}


def make_overridden_dir(model_path: str, overrides: Mapping[str, Any], target: Path, *, rank: int = 0) -> Path:
    """``target``: ``model_path``'s entries linked and ``config.json`` overridden (see the module
    docstring); kept as it is when it was made from the same directory with the same overrides,
    else made again (:func:`core_rl.roles.derived_dirs.made_once`: rank 0 makes it, the others wait)."""
    source = Path(model_path).resolve()
    config = json.dumps(overridden_config(str(source), overrides), indent=2, sort_keys=True) + "\n"
    stamp = json.dumps({"model_path": str(source), "config": config}, sort_keys=True)

    def fill(partial: Path) -> None:
        for entry in source.iterdir():
            if entry.name not in ("config.json", STAMP):
                os.symlink(entry, partial / entry.name)
        (partial / "config.json").write_text(config, encoding="utf-8")

    return made_once(target, stamp, fill, rank=rank, what="model_overrides")


def apply_model_overrides(cfg: RunConfig, *, root: Path | None = None) -> list[str]:
    """For each role section (actor first) with ``model_overrides``: check its keys, make its
    directory under ``root`` (default ``<run>/model_overrides``) and point the section's
    ``model_path`` there (recorded as derived; the tokenizer's files are linked too). Returns the
    problems (no directory is made for a section with any)."""
    root = root if root is not None else cfg.experiment.run_dir / "model_overrides"
    rank = int(os.environ.get("RANK", "0"))
    problems: list[str] = []
    for role, section in [("actor", cfg.actor), *role_sections(cfg)]:
        if not section.model_overrides or not (Path(section.model_path) / "config.json").is_file():
            continue  # a missing model directory is preflight's to report
        if Path(section.model_path).resolve() == (root / role).resolve():
            continue  # applied already (this configuration was checked before)
        found = config_problems(
            section.model_path, section.model_overrides, role, trust_remote_code=section.trust_remote_code
        )
        problems += found
        if found:
            continue
        original = section.model_path
        try:
            made = make_overridden_dir(original, section.model_overrides, root / role, rank=rank)
        except (OSError, TimeoutError) as exc:
            problems.append(
                f"experiment.output_dir: cannot make {root / role} for {role}.model_overrides ({exc}); choose a "
                "writable experiment.output_dir"
            )
            continue
        section.model_path = str(made)
        source = f"{original} with {role}.model_overrides ({', '.join(sorted(section.model_overrides))})"
        record(cfg, Derived((role, "model_path"), section.model_path, original, source, at_start=True))
    return problems
