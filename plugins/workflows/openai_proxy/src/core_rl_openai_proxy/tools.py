"""Tool calls in chat completions, as an OpenAI client expects them.

A request's ``tools`` reach the chat template (a template that ignores them is a 400: the model
would never see the tools). When the request carries tools (and ``tool_choice`` is not ``"none"``),
the sampled text is parsed by the run's tool-call parser (``rollout.workflow.tool_parser``, a
:class:`core_rl.rollout.tool_parsers.ToolParser` from core's registry; ``hermes`` by default): its calls
become ``message.tool_calls`` (``id``, ``type: "function"``, ``function.name``,
``function.arguments`` a JSON string), the text outside them ``message.content`` (``None`` when
empty) and ``finish_reason`` ``tool_calls``. A turn with a malformed call, or none, stays text.

What is parsed is only the response: the trajectory keeps the sampled token ids. When the client
sends the reply back (the assistant message with its ``tool_calls``), :func:`same_reply` checks it
is the reply the proxy returned, and the chat module joins the call to the sampled tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from core_rl.config.schema import PluginSpec
from core_rl.rollout import ToolParser

from core_rl_openai_proxy.errors import RequestError
from core_rl_openai_proxy.reasoning import split_reasoning

TOOL_CHOICES = ("none", "auto", "required")


def build_tool_parser(spec: PluginSpec | None) -> ToolParser | None:
    """The parser of ``rollout.workflow.tool_parser`` (``None``: tool calls stay text). A section
    the configuration loader did not validate (a config built in code) is validated here."""
    if spec is None:
        return None
    if spec.entry is None:
        from core_rl.config.sections import validate_plugin_section
        from core_rl.plugins import TOOL_PARSER, PluginHost

        validate_plugin_section(PluginHost(), TOOL_PARSER, spec, "rollout.workflow.tool_parser")
    return spec.build()


def request_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The request's ``tools`` (``None`` when absent or empty), each checked to be a function
    tool ``{"type": "function", "function": {"name": str, ...}}``; a bad ``tool_choice`` is a 400."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES and not _is_named_choice(choice):
        raise RequestError(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of function tools", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function" or not function.get("name"):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                param=f"tools[{i}]",
            )
    return tools


def _is_named_choice(choice: Any) -> bool:
    return isinstance(choice, dict) and isinstance(choice.get("function"), dict) and "name" in choice["function"]


def message_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat-template input: ``{"id"?, "type": "function",
    "function": {"name", "arguments"}}`` with ``arguments`` decoded from its JSON string into an
    object (what Hugging Face chat templates expect); a malformed list is a 400 naming ``where``."""
    if not isinstance(value, list):
        raise RequestError(f"{where}.tool_calls must be a list of tool calls", param=where)
    out = []
    for k, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                f"{where}.tool_calls[{k}] must be {{'type': 'function', "
                "'function': {'name': ..., 'arguments': ...}}",
                param=where,
            )
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise RequestError(
                    f"{where}.tool_calls[{k}].function.arguments is not valid JSON: {exc}", param=where
                ) from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{where}.tool_calls[{k}].function.arguments must be a JSON object", param=where)
        item: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            item["id"] = call["id"]
        out.append(item)
    return out


@attrs.frozen
class Reply:
    """A chat call's answer: ``content`` (``None``: tool calls only), ``tool_calls`` in the
    response's form (``[]``: a text reply) and the message a client sends back (template form)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = attrs.field(factory=list)
    reasoning_content: str | None = None

    def message(self) -> dict[str, Any]:
        """The reply as :func:`core_rl_openai_proxy.chat.normalize_messages` makes the message a
        client sends back: ``content`` a string, ``tool_calls`` with decoded arguments."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = message_tool_calls(self.tool_calls, "reply")
        return out

    def finish_reason(self, sampled: str) -> str:
        """``tool_calls`` for a turn that stopped with calls, else the turn's own (``stop``/``length``)."""
        return "tool_calls" if self.tool_calls and sampled == "stop" else sampled


def split_reply(
    text: str,
    parser: ToolParser | None,
    tools: Sequence[Any] | None,
    tool_choice: Any,
    reasoning_tags: Sequence[str] | None = None,
) -> Reply:
    """The reply to a chat call whose sampled text is ``text`` (see the module docstring): its
    reasoning split off first (:mod:`core_rl_openai_proxy.reasoning`), then the calls parsed from
    the answer."""
    reasoning, text = split_reasoning(text, reasoning_tags)
    if parser is None or not tools or tool_choice == "none":
        return Reply(text, reasoning_content=reasoning)
    parsed = parser.parse(text)
    if parsed.errors or not parsed.calls:
        return Reply(text, reasoning_content=reasoning)
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in parsed.calls
    ]
    return Reply(parsed.content or None, calls, reasoning)


def same_reply(got: Mapping[str, Any], returned: Mapping[str, Any]) -> bool:
    """Whether the assistant message ``got`` (normalised) is the reply the proxy returned
    (:meth:`Reply.message`): the same content and the same calls (names and arguments; ids and
    extra keys may differ)."""

    def calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]

    return (
        got.get("role") == "assistant"
        and got.get("content", "") == returned.get("content", "")
        and calls(got) == calls(returned)
    )
