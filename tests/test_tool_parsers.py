"""The built-in tool-call parsers against the conformance kit: formatted calls parse back
(hypothesis round-trip), malformed JSON and unclosed tags are errors, any text parses without
raising; and what each format reads from hand-written model output."""

from __future__ import annotations

from typing import Any, ClassVar

from core_rl.builtin import tool_parsers as builtin
from core_rl.rollout.tool_parsers import HermesConfig, HermesParser, Llama3JsonParser, TagsConfig, TagsParser, ToolCall
from core_rl.testing import ToolParserContract
from hypothesis import strategies as st

CALC = ToolCall("calculator", {"expression": "12+34"})


def no_closing_tag():
    """Calls whose JSON cannot hold the closing tag (a model's JSON would end the call there too)."""
    from core_rl.testing.environment_contracts import default_calls

    return default_calls().filter(lambda c: "</tool_call>" not in str(c.arguments))


class TestHermes(ToolParserContract):
    plugin = builtin
    name = "hermes"
    distribution = "core-rl"
    calls: ClassVar[list[ToolCall]] = [CALC, ToolCall("search", {"q": 'a "quoted" word', "k": 3}), ToolCall("f")]
    malformed: ClassVar[list[str]] = [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
    ]
    call_strategy: ClassVar[Any] = staticmethod(no_closing_tag)


class TestLlama3Json(ToolParserContract):
    plugin = builtin
    name = "llama3_json"
    distribution = "core-rl"
    calls: ClassVar[list[ToolCall]] = [CALC, ToolCall("get_weather", {"city": "Paris"})]
    malformed: ClassVar[list[str]] = ['{"name": "f", "parameters": ', '{"parameters": {}}', '{"name": "f"} trailing']


def tag_calls():
    """The tags format's calls: an identifier and one input without the tag characters or edge spaces."""
    names = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
    inputs = st.text(st.characters(blacklist_characters="<>", blacklist_categories=("Cs", "Zs", "Cc")), max_size=30)
    return st.builds(lambda n, i: ToolCall(n, {"input": i}), names, inputs)


class TestTags(ToolParserContract):
    plugin = builtin
    name = "tags"
    distribution = "core-rl"
    calls: ClassVar[list[ToolCall]] = [ToolCall("calculator", {"input": "12+34"})]
    malformed: ClassVar[list[str]] = ["<tool>calculator 1+2", "<tool>1+2</tool>"]
    call_strategy: ClassVar[Any] = staticmethod(tag_calls)


class TestTagsWithOneTool(ToolParserContract):
    plugin = builtin
    name = "tags"
    options: ClassVar[dict[str, Any]] = {"tag": "c", "tool": "calculator"}
    calls: ClassVar[list[ToolCall]] = [ToolCall("calculator", {"input": "37+45"})]
    malformed: ClassVar[list[str]] = ["<c>37+4"]
    call_strategy: ClassVar[Any] = staticmethod(lambda: tag_calls().map(lambda c: ToolCall("calculator", c.arguments)))


def test_model_output_by_hand() -> None:
    hermes = HermesParser(HermesConfig())
    text = 'Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    parsed = hermes.parse(text)
    assert parsed.calls == (ToolCall("calculator", {"expression": "2+2"}),)
    assert parsed.content == "Let me add." and not parsed.errors
    bad = hermes.parse('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"</tool_call>')
    assert not bad.calls and "not valid JSON" in bad.errors[0]

    llama = Llama3JsonParser()
    two = llama.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert two.calls == (ToolCall("a", {"x": 1}), ToolCall("b", {}))
    assert llama.parse("The answer is 4.").content == "The answer is 4."

    tags = TagsParser(TagsConfig(tag="c", tool="calculator"))
    assert tags.parse("<c>37+45</c>").calls == (ToolCall("calculator", {"input": "37+45"}),)
    assert tags.parse("82").content == "82" and not tags.parse("82").calls
