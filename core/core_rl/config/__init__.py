"""Configuration: typed schema (:mod:`.schema`) and loading with validation (:mod:`.loader`).

Attributes are imported lazily so that ``core_rl.config.validators`` (used by plugin registration
modules) stays cheap to import.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "PluginSpec": "core_rl.config.schema",
    "RunConfig": "core_rl.config.schema",
    "load_config": "core_rl.config.loader",
    "structure": "core_rl.config.loader",
    "to_plain": "core_rl.config.loader",
    "to_yaml": "core_rl.config.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'core_rl.config' has no attribute {name!r}")
