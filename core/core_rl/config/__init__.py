"""Configuration: typed schema (:mod:`.schema`) and loading with validation (:mod:`.loader`)."""

from core_rl.config.loader import load_config, structure, to_plain, to_yaml
from core_rl.config.schema import PluginSpec, RunConfig

__all__ = ["PluginSpec", "RunConfig", "load_config", "structure", "to_plain", "to_yaml"]
