"""The built-in tool-call parsers ``hermes``, ``llama3_json`` and ``tags`` (see :mod:`core_rl.rollout.tool_parsers`)."""

from __future__ import annotations

from core_rl.hookspecs import Register, hookimpl
from core_rl.rollout.tool_parsers import HermesConfig, HermesParser, Llama3JsonParser, TagsConfig, TagsParser


@hookimpl
def core_rl_register_tool_parsers(register: Register) -> None:
    register(
        "hermes",
        HermesParser,
        config_cls=HermesConfig,
        description='Qwen/Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
    )
    register(
        "llama3_json",
        Llama3JsonParser,
        description='Llama 3: the turn is {"name": ..., "parameters": {...}} (";" between calls)',
    )
    register("tags", TagsParser, config_cls=TagsConfig, description="plain tags: <tool>name input</tool>")
