"""Tool calls through the proxy, over real HTTP with the real ``openai`` client, in front of the real
``hf`` engine on a scripted tiny model (:mod:`core_rl.testing.scripted_model`: its weights make it answer a prompt
ending in ``:`` with a hermes tool call and one ending in ``!`` with a malformed one).

- a reply holding a call comes back as ``message.tool_calls`` (``finish_reason: tool_calls``);
- the client's follow-up (the assistant message with its ``tool_calls``, then a ``tool`` message)
  continues the trajectory: the trained ids are the sampled ids, exactly (not the template's
  rendering of the call), and only the tool message is inserted, masked;
- a malformed call, or the parser turned off, leaves the text as content;
- tools the chat template cannot render, and malformed tools or tool calls, are OpenAI-style 400s.
"""

from __future__ import annotations

import json

import httpx
import pytest
from core_rl.config.schema import PluginSpec
from proxy_agents import LOG, TEMPLATE, TOOL_TEMPLATE, TOOLS, client

AGENTS = "proxy_agents"
CALL = '{"name":"add","arguments":{"a":3,"b":4}}'  # compact: the template's tojson writes it with spaces
GOOD = ["let me add.", "<tool_call>", CALL, "</tool_call>"]
BAD = '<tool_call>{"name":"add","arguments":{"a":3,}}</tool_call>'
#: TOOL_TEMPLATE with assistant turns opened by "a!": the model answers with the malformed call
BAD_TEMPLATE = TOOL_TEMPLATE.replace("a:", "a!")
ROWS = [{"prompt": "3+4"}]
OPTIONS = {"program": f"{AGENTS}:uses_tools", "max_context_tokens": 400, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from core_rl.testing.scripted_model import build_scripted_model

    return build_scripted_model(tmp_path_factory.mktemp("scripted") / "model", {":": GOOD, "!": [BAD]})


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_tool_call_is_returned_and_its_result_continues_the_trajectory(run_wave, tokenizer) -> None:
    LOG.clear()
    wave, _ = run_wave(ROWS, n=2, chat_template=TOOL_TEMPLATE, **OPTIONS)
    (group,) = wave.groups
    sampled = [tokenizer.convert_tokens_to_ids(t) for t in GOOD] + [tokenizer.eos_token_id]
    assert len(group) == 2
    for sample in group:
        assert sample.info["calls"] == 2 and sample.info["trajectories"] == 1
        assert sample.info["history_mismatches"] == 0
        first, second = (call["choices"][0] for call in LOG[sample.info["session"]])
        for choice in (first, second):  # the model calls the tool again after the result
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["content"] == "let me add."
            (call,) = choice["message"]["tool_calls"]
            assert call["id"].startswith("call_") and call["type"] == "function"
            assert call["function"]["name"] == "add"
            assert json.loads(call["function"]["arguments"]) == {"a": 3, "b": 4}
            assert choice["token_ids"] == sampled
            assert choice["logprobs"]["content"][0]["logprob"] == pytest.approx(0.0, abs=1e-4)
        assert first["message"]["tool_calls"][0]["id"] != second["message"]["tool_calls"][0]["id"]
        assert sample.prompt_ids == _encode(tokenizer, "<s>s:add(a,b)>u:3+4>a:")
        # the model stopped on </s>, so only the tool message and the generation prompt are new
        inserted = _encode(tokenizer, "t:<tool_response>7</tool_response>>a:")
        assert second["prompt_token_ids"] == sample.prompt_ids + sampled + inserted
        assert sample.response_ids == sampled + inserted + sampled
        assert sample.token_mask == [1] * len(sampled) + [0] * len(inserted) + [1] * len(sampled)
        assert sample.logprobs[len(sampled) : -len(sampled)] == [0.0] * len(inserted)
        assert sample.logprobs == pytest.approx([0.0] * len(sample.response_ids), abs=1e-4)
        # re-rendering the conversation (the call as the template writes it) gives other ids
        messages = [
            {"role": "user", "content": "3+4"},
            {"role": "assistant", "content": "let me add.", "tool_calls": [{"function": json.loads(CALL)}]},
            {"role": "tool", "content": "7"},
        ]
        rendered = tokenizer.apply_chat_template(
            messages, tools=TOOLS, chat_template=TOOL_TEMPLATE, tokenize=False, add_generation_prompt=True
        )
        assert _encode(tokenizer, rendered) != second["prompt_token_ids"]


@pytest.mark.parametrize("case", ["malformed", "parser_off"])
def test_a_call_that_is_not_parsed_stays_text(run_wave, tokenizer, case) -> None:
    """A malformed call (no 500), or any call with ``tool_parser: null``, is the reply's content;
    the next call continues the trajectory as after any text reply."""
    LOG.clear()
    if case == "malformed":
        wave, _ = run_wave(ROWS, n=1, chat_template=BAD_TEMPLATE, **OPTIONS)
        text, sampled, glue = BAD, [tokenizer.convert_tokens_to_ids(BAD)], "u:again>a!"
    else:
        wave, _ = run_wave(ROWS, n=1, chat_template=TOOL_TEMPLATE, tool_parser=None, **OPTIONS)
        text, sampled, glue = "".join(GOOD), [tokenizer.convert_tokens_to_ids(t) for t in GOOD], "u:again>a:"
    ((sample,),) = wave.groups
    first, second = (call["choices"][0] for call in LOG[sample.info["session"]])
    for choice in (first, second):
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == text and choice["message"]["tool_calls"] is None
    sampled += [tokenizer.eos_token_id]
    inserted = _encode(tokenizer, glue)
    assert sample.info["trajectories"] == 1 and sample.info["history_mismatches"] == 0
    assert sample.response_ids == sampled + inserted + sampled
    assert sample.token_mask == [1] * len(sampled) + [0] * len(inserted) + [1] * len(sampled)


async def _tool_mistakes(base_url: str, api_key: str, row: dict) -> float:
    """Each mistake is a 400 with an OpenAI error body naming it; a correct call still works."""
    user = {"role": "user", "content": "3+4"}
    bad_call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": "{"}}]}
    requests = {
        "not_rendered": {"messages": [user], "tools": TOOLS, "tool_choice": "auto"},
        "bad_tools": {"messages": [user], "tools": [{"type": "function"}]},
        "bad_choice": {"messages": [user], "tools": TOOLS, "tool_choice": "sometimes"},
        "bad_arguments": {"messages": [user, bad_call, {"role": "tool", "content": "7"}]},
    }
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}) as raw:
        answers = {name: await raw.post("/chat/completions", json=body) for name, body in requests.items()}
    await client(base_url, api_key).chat.completions.create(model="policy", messages=[user], max_tokens=2)
    LOG[api_key] = [{name: (r.status_code, r.json()["error"]) for name, r in answers.items()}]
    return 1.0


def test_tool_mistakes_are_openai_errors(run_wave, monkeypatch) -> None:
    import proxy_agents

    monkeypatch.setattr(proxy_agents, "tool_mistakes", _tool_mistakes, raising=False)
    LOG.clear()
    # the plain template renders no tools: a request with tools is refused rather than hiding them
    wave, _ = run_wave(ROWS, n=1, program=f"{AGENTS}:tool_mistakes", chat_template=TEMPLATE)
    ((entry,),) = LOG.values()
    assert {name: status for name, (status, _) in entry.items()} == dict.fromkeys(entry, 400)
    errors = {name: error for name, (_, error) in entry.items()}
    assert errors["not_rendered"]["code"] == "tools_not_rendered" and errors["not_rendered"]["param"] == "tools"
    assert "does not render them" in errors["not_rendered"]["message"]
    assert errors["bad_tools"]["param"] == "tools[0]"
    assert errors["bad_choice"]["param"] == "tool_choice"
    assert "messages[1].tool_calls[0].function.arguments is not valid JSON" in errors["bad_arguments"]["message"]
    ((sample,),) = wave.groups
    assert sample.info["calls"] == 1


def test_a_tool_parser_section_is_validated_by_name() -> None:
    from core_rl.errors import ConfigError
    from core_rl_openai_proxy.tools import build_tool_parser

    parser = build_tool_parser(PluginSpec(name="tags", options={"tag": "c", "tool": "calc"}))
    assert [c.name for c in parser.parse("<c>1+2</c>").calls] == ["calc"]
    with pytest.raises(ConfigError, match=r"rollout.workflow.tool_parser.name: .*'nope'"):
        build_tool_parser(PluginSpec(name="nope"))
