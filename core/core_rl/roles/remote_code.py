"""Models that ship their own modelling code (``<role>.trust_remote_code``).

A Hugging Face directory whose ``config.json`` (or ``tokenizer_config.json``) has an ``auto_map``
names Python files in that directory (``configuration_*.py``, ``modeling_*.py``,
``tokenization_*.py``) that transformers imports to build the config, model or tokenizer. Running
them is running the directory's code, so core-rl does it only where the role section that names
the directory says ``trust_remote_code: true``.

The switch is per role section (``actor``, ``ref``, ``critic``, ``teacher``, ``reward_model``)
rather than run-wide because trust belongs to a directory, and each role names its own: trusting
the policy's code must not run a teacher's from elsewhere. The rollout engine and the inference
servers serve the policy, so they follow ``actor.trust_remote_code``; a reference built from the
actor's section (no ``ref:``) follows it too.

- :func:`untrusted_code_problem`: preflight's refusal of such a directory without the switch (one
  line naming the key, the ``auto_map`` and its files), instead of transformers' error mid-run;
- :func:`engine_problems`: at ``config validate``, the switch on a role whose train engine (or,
  for the actor, the rollout engine) does not declare it can load custom code (``loads_remote_code
  = True`` on its config class);
- :func:`keep_custom_code`: an export of such a model keeps its code files and ``auto_map``, so it
  loads again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core_rl.config.schema import ActorConfig, RunConfig
    from core_rl.plugins.host import PluginHost

#: the config key of a role section
KEY = "trust_remote_code"
#: the config-class attribute by which an engine declares it passes ``trust_remote_code`` on
SUPPORT_ATTRIBUTE = "loads_remote_code"
#: the files of a Hugging Face directory that may hold an ``auto_map``
MAPPED_FILES = ("config.json", "tokenizer_config.json")


def _read_auto_map(path: Path) -> dict[str, Any]:
    """The ``auto_map`` of the JSON file at ``path`` (``{}`` without one, or when it cannot be read:
    a corrupt file is reported by the checks that read it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    auto_map = data.get("auto_map") if isinstance(data, dict) else None
    return auto_map if isinstance(auto_map, dict) else {}


def _module_file(reference: str) -> str:
    """``configuration_tiny.TinyConfig`` -> ``configuration_tiny.py`` (a ``repo--`` prefix, which
    points at another hub repository, is kept as written)."""
    module = reference.rsplit(".", 1)[0]
    return f"{module}.py"


def auto_maps(directory: str | Path) -> dict[str, dict[str, list[str]]]:
    """File name -> ``{auto class: [code files]}`` of every :data:`MAPPED_FILES` of ``directory``
    that has an ``auto_map`` (empty: the directory needs no code of its own)."""
    found: dict[str, dict[str, list[str]]] = {}
    for name in MAPPED_FILES:
        auto_map = _read_auto_map(Path(directory) / name)
        entries = {}
        for auto_class, value in auto_map.items():
            refs = value if isinstance(value, list) else [value]
            files = [_module_file(ref) for ref in refs if isinstance(ref, str) and ref]
            if files:
                entries[str(auto_class)] = files
        if entries:
            found[name] = entries
    return found


def needs_remote_code(directory: str | Path) -> bool:
    """Whether ``directory``'s config or tokenizer asks transformers to run its own code."""
    return bool(auto_maps(directory))


def untrusted_code_problem(directory: str | Path, key: str, trusted: bool) -> str | None:
    """The problem of the model directory at config ``key`` (``actor.model_path``, ...) when it
    asks for its own code and ``trusted`` is false: names the directory, the ``auto_map`` entries
    with their files and the switch to set; ``None`` when it needs none or is trusted."""
    if trusted:
        return None
    maps = auto_maps(directory)
    if not maps:
        return None
    shown = "; ".join(
        f"{name}: " + ", ".join(f"{cls} -> {' / '.join(files)}" for cls, files in entries.items())
        for name, entries in maps.items()
    )
    section = key.rsplit(".", 1)[0]
    return (
        f"{key}: {str(directory)!r} ships its own modelling code, which transformers would run (auto_map in {shown}); "
        f"set {section}.{KEY}: true if you trust the code in that directory, or use a model transformers supports"
    )


def engine_problems(cfg: RunConfig, host: PluginHost) -> list[str]:
    """``<role>.trust_remote_code: true`` where the role's train engine does not declare that it
    loads custom code (:data:`SUPPORT_ATTRIBUTE` on its config class), and ``actor.trust_remote_code``
    where the rollout engine, which serves the actor's model, does not."""
    from core_rl.plugins.kinds import ROLLOUT_ENGINE, TRAIN_ENGINE
    from core_rl.roles.build import role_sections

    problems = []
    sections: list[tuple[str, ActorConfig]] = [("actor", cfg.actor), *role_sections(cfg)]
    for role, section in sections:
        if not getattr(section, KEY, False):
            continue
        entry = host.registries[TRAIN_ENGINE.key].get(section.engine.name)
        if entry is not None and not getattr(entry.config_cls, SUPPORT_ATTRIBUTE, False):
            problems.append(_unsupported(f"{role}.{KEY}", "train", entry, f"{role}.engine.name", "fsdp or deepspeed"))
    if cfg.actor.trust_remote_code:
        entry = host.registries[ROLLOUT_ENGINE.key].get(cfg.rollout.engine.name)
        if entry is not None and not getattr(entry.config_cls, SUPPORT_ATTRIBUTE, False):
            problems.append(_unsupported(f"actor.{KEY}", "rollout", entry, "rollout.engine.name", "hf, vllm or sglang"))
    return problems


def rollout_factory_kwargs(cfg: RunConfig) -> dict[str, bool]:
    """The keyword arguments to add to a rollout engine factory's call for this run:
    ``trust_remote_code=True`` with ``actor.trust_remote_code``, else none (so engines that load no
    custom code keep their factory signature; :func:`engine_problems` refused the switch for them)."""
    return {KEY: True} if cfg.actor.trust_remote_code else {}


def _unsupported(key: str, kind: str, entry: Any, engine_key: str, instead: str) -> str:
    return (
        f"{key}: true, but {kind} engine {entry.name!r} (distribution {entry.distribution}) cannot load a model's own "
        f"code (its config class does not set {SUPPORT_ATTRIBUTE} = True); set {engine_key} to {instead}, or use a "
        "model transformers supports"
    )


def keep_custom_code(sources: Iterable[str | Path], target: Path) -> list[str]:
    """Make the Hugging Face directory ``target`` (just written from a model and tokenizer loaded
    from ``sources``) load again as its sources did: each source's top-level ``*.py`` file missing
    from ``target`` is copied there, and each ``auto_map`` a source's :data:`MAPPED_FILES` has and
    ``target``'s lacks is written into it. Returns the names of the copied files. Sources that need
    no code of their own change nothing."""
    copied: list[str] = []
    for source in dict.fromkeys(Path(s) for s in sources):
        if not needs_remote_code(source):
            continue
        for code in sorted(source.glob("*.py")):
            if not (target / code.name).exists():
                shutil.copyfile(code, target / code.name)
                copied.append(code.name)
        for name in MAPPED_FILES:
            auto_map = _read_auto_map(source / name)
            written = target / name
            if not auto_map or not written.is_file() or _read_auto_map(written):
                continue
            data = json.loads(written.read_text(encoding="utf-8"))
            data["auto_map"] = auto_map
            written.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return copied
