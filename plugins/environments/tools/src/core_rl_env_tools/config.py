"""Config classes of the environments (each its YAML section's options)."""

from __future__ import annotations

import attrs
from core_rl.config.schema import PluginSpec, plugin_section
from core_rl.config.validators import positive
from core_rl.plugins import REWARD, TOOL_PARSER


@attrs.define
class ToolEnvConfig:
    """A tool environment's options: ``parser`` (a tool-call parser section, e.g. ``{name: hermes}``),
    ``reward`` (any reward section, scoring the final answer: the first turn without a tool call),
    ``result_format`` / ``error_format`` (the observation after a call: ``{result}`` / ``{error}``
    replaced), and ``max_calls`` (calls run per turn; more are refused in the observation)."""

    reward: PluginSpec = plugin_section(REWARD)  # noqa: RUF009 (an attrs field, like attrs.field)
    parser: PluginSpec = plugin_section(TOOL_PARSER, factory=lambda: PluginSpec(name="hermes"))  # noqa: RUF009 (an attrs field, like attrs.field)
    result_format: str = "<tool_response>{result}</tool_response>"
    error_format: str = "<tool_response>error: {error}</tool_response>"
    max_calls: int = attrs.field(default=4, validator=positive())


@attrs.define
class PythonEnvConfig(ToolEnvConfig):
    """A tool environment whose tool ``python`` runs ``{"code": ...}`` (or the ``tags`` parser's
    ``input``) in the code reward's sandbox; ``timeout_s``, ``memory_mb``: its limits per run."""

    timeout_s: float = attrs.field(default=5.0, validator=positive())
    memory_mb: int = attrs.field(default=512, validator=positive())


@attrs.define
class RewardEnvConfig:
    """``reward``: the reward section that scores the one turn."""

    reward: PluginSpec = plugin_section(REWARD)  # noqa: RUF009 (an attrs field, like attrs.field)
