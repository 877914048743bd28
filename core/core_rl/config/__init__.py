"""Configuration: typed schema (:mod:`.schema`) and loading with validation (:mod:`.loader`).

Attributes are imported lazily so that ``core_rl.config.validators`` (used by plugin registration
modules) stays cheap to import.
"""

from __future__ import annotations

from core_rl.plugins.lazy_exports import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "core_rl.config.schema": ("PluginSpec", "RunConfig"),
        "core_rl.config.loader": ("load_config", "structure", "to_plain", "to_yaml"),
    },
)
