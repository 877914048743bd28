"""Tool calls in a model's text: the :class:`ToolParser` interface (a plugin kind registered through
:func:`core_rl.hookspecs.core_rl_register_tool_parsers`) and the three formats core registers
(:mod:`core_rl.builtin.tool_parsers`):

- ``hermes`` (Qwen, Hermes): ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number
  of them in a turn;
- ``llama3_json`` (Llama 3): the whole turn is ``{"name": "f", "parameters": {...}}`` (optionally after
  ``<|python_tag|>``; several separated by ``;``);
- ``tags``: ``<tool>f input text</tool>`` (``tag`` and a fixed ``tool`` name configurable, e.g.
  ``<c>12+34</c>`` for a calculator on a character vocabulary); the input is ``{"input": text}``.

A parser never raises on what a model wrote: a malformed call becomes an entry of
:attr:`ParsedTurn.errors` (the environment tells the model, as its observation).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

import attrs


@attrs.frozen
class ToolCall:
    """A call of tool ``name`` with ``arguments`` (JSON-like)."""

    name: str
    arguments: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class ParsedTurn:
    """A model turn split into its ``calls`` (in order), ``errors`` (one line per malformed call)
    and ``content`` (the text outside the calls, stripped)."""

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()
    content: str = ""


class ToolParser(ABC):
    """Finds tool calls in a turn's text and writes them (the inverse, for prompts and tests):
    ``parse(format_call(c)).calls == (c,)`` for every call the format can express."""

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The calls of ``text``; never raises on malformed input (see :class:`ParsedTurn`)."""

    @abstractmethod
    def format_call(self, call: ToolCall) -> str:
        """``call`` written the way a model of this family writes it."""


def call_from_json(body: str, arguments_key: str) -> ToolCall:
    """``{"name": str, arguments_key: object}`` (JSON text) as a :class:`ToolCall`; ``ValueError``
    naming what is wrong otherwise."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at character {e.pos})") from None
    return call_from_data(data, arguments_key)


def call_from_data(data: Any, arguments_key: str) -> ToolCall:
    """:func:`call_from_json` of decoded JSON."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ValueError('a call is a JSON object with a string "name"')
    arguments = data.get(arguments_key, {})
    if not isinstance(arguments, dict):
        raise ValueError(f'"{arguments_key}" must be a JSON object')
    return ToolCall(data["name"], arguments)


@attrs.define
class HermesConfig:
    """``tag``: the element holding each call (``tool_call``)."""

    tag: str = "tool_call"


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    def __init__(self, config: HermesConfig) -> None:
        tag = re.escape(config.tag)
        self.open, self.close = f"<{config.tag}>", f"</{config.tag}>"
        self.pattern = re.compile(f"<{tag}>(.*?)(?:</{tag}>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for match in self.pattern.finditer(text):
            try:
                calls.append(call_from_json(match.group(1).strip(), "arguments"))
            except ValueError as e:
                errors.append(f"tool call {match.group(0)[:60]!r}: {e}")
        return ParsedTurn(tuple(calls), tuple(errors), self.pattern.sub("", text).strip())

    def format_call(self, call: ToolCall) -> str:
        return f"{self.open}{json.dumps({'name': call.name, 'arguments': call.arguments})}{self.close}"


class Llama3JsonParser(ToolParser):
    """A turn that starts with ``{`` (after ``<|python_tag|>``) is ``;``-separated JSON calls
    ``{"name": ..., "parameters": {...}}`` (one malformed: the turn is an error, no call is made);
    any other turn is content."""

    PREFIX = "<|python_tag|>"

    def __init__(self, config: None = None) -> None:
        self.decoder = json.JSONDecoder()

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip().removeprefix(self.PREFIX).strip()
        if not body.startswith("{"):
            return ParsedTurn(content=text.strip())
        calls, position = [], 0
        try:  # all or nothing: a turn with a malformed call makes no call
            while True:
                data, position = self.decoder.raw_decode(body, position)
                calls.append(call_from_data(data, "parameters"))
                rest = body[position:].lstrip()
                if not rest:
                    return ParsedTurn(tuple(calls))
                if not rest.startswith(";"):
                    raise ValueError(f"text after a call: {rest[:40]!r} (separate calls with ';')")
                position = len(body) - len(rest[1:].lstrip())
        except json.JSONDecodeError as e:
            return ParsedTurn(errors=(f"tool calls {body[:60]!r}: not valid JSON ({e.msg} at character {e.pos})",))
        except ValueError as e:
            return ParsedTurn(errors=(f"tool calls {body[:60]!r}: {e}",))

    def format_call(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "parameters": call.arguments})


@attrs.define
class TagsConfig:
    """``tag``: the element of a call (``<tool>...</tool>``); ``tool``: the one tool every call
    names (its whole body is the input), or ``None``: the body is ``name input``."""

    tag: str = attrs.field(default="tool", validator=attrs.validators.matches_re(r"[A-Za-z_][A-Za-z0-9_-]*"))
    tool: str | None = None


class TagsParser(ToolParser):
    """``<tag>name input</tag>`` (or ``<tag>input</tag>`` with a fixed ``tool``) -> ``ToolCall(name,
    {"input": input})``."""

    def __init__(self, config: TagsConfig) -> None:
        self.config = config
        tag = re.escape(config.tag)
        self.open, self.close = f"<{config.tag}>", f"</{config.tag}>"
        self.pattern = re.compile(f"<{tag}>(.*?)(</{tag}>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for match in self.pattern.finditer(text):
            body, closed = match.group(1), bool(match.group(2))
            if not closed:
                errors.append(f"tool call {match.group(0)[:60]!r}: no closing {self.close}")
                continue
            if self.config.tool is not None:
                calls.append(ToolCall(self.config.tool, {"input": body}))
                continue
            name, _, rest = body.strip().partition(" ")
            if not name.isidentifier():
                errors.append(f"tool call {match.group(0)[:60]!r}: starts with no tool name")
                continue
            calls.append(ToolCall(name, {"input": rest}))
        return ParsedTurn(tuple(calls), tuple(errors), self.pattern.sub("", text).strip())

    def format_call(self, call: ToolCall) -> str:
        text = str(call.arguments.get("input", ""))
        body = text if self.config.tool is not None else f"{call.name} {text}"
        return f"{self.open}{body}{self.close}"
