"""The Responses API and streaming through the proxy, over real HTTP with the real ``openai`` client,
in front of the real ``hf`` engine on the scripted tiny tool-calling model (as in
test_proxy_tools.py: it answers a prompt ending in ``:`` with ``let me add.`` and a hermes call of
``add``).

Each way of holding the conversation (the whole input sent back, or ``previous_response_id``),
streamed or not, and streamed chat completions, give the episode the same trajectory as plain chat
completions do: the sampled ids of both turns, and between them only the tool result, masked; the
replies carry the parsed call (a ``function_call`` item, or ``tool_calls`` deltas) and the streamed
log-probs are the recorded ones."""

from __future__ import annotations

import json

import pytest
from proxy_agents import LOG, TOOL_TEMPLATE, TOOLS, client

AGENTS = "proxy_agents"
CALL = '{"name":"add","arguments":{"a":3,"b":4}}'
GOOD = ["let me add.", "<tool_call>", CALL, "</tool_call>"]
ROWS = [{"prompt": "3+4"}]
OPTIONS = {"max_context_tokens": 400, "max_new_tokens": 8, "chat_template": TOOL_TEMPLATE}
#: the tools in the Responses API's form
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from core_rl.testing.scripted_model import build_scripted_model

    return build_scripted_model(tmp_path_factory.mktemp("scripted") / "model", {":": GOOD})


async def _create(c, stream: bool, **request):
    """``responses.create``, streamed or not; the final response and the stream's event types."""
    if not stream:
        return await c.responses.create(**request), []
    kinds, final = [], None
    async for event in await c.responses.create(stream=True, **request):
        kinds.append(event.type)
        if event.type == "response.completed":
            final = event.response
    return final, kinds


async def _responses_agent(base_url: str, api_key: str, row: dict, *, previous: bool, stream: bool) -> float:
    """Two Responses calls: the question, then the call's result (after the whole input, or
    after ``previous_response_id``)."""
    c = client(base_url, api_key)
    request = {
        "model": "policy",
        "instructions": None,
        "tools": RESPONSE_TOOLS,
        "include": ["message.output_text.logprobs"],
    }
    items: list = [{"role": "user", "content": row["prompt"]}]
    first, kinds = await _create(c, stream, input=items, **{k: v for k, v in request.items() if v is not None})
    calls = [item for item in first.output if item.type == "function_call"]
    results = [
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": str(sum(json.loads(call.arguments).values())),
        }
        for call in calls
    ]
    if previous:
        follow = {"input": results, "previous_response_id": first.id}
    else:
        follow = {"input": [*items, *[item.model_dump(exclude_none=True) for item in first.output], *results]}
    second, _ = await _create(c, stream, **follow, **{k: v for k, v in request.items() if v is not None})
    LOG.setdefault(api_key, []).extend([first.model_dump(), second.model_dump(), {"events": kinds}])
    return 1.0


async def _streamed_chat(base_url: str, api_key: str, row: dict) -> float:
    """Two streamed chat calls, the reply rebuilt from the deltas and sent back with the result."""
    c = client(base_url, api_key)
    messages: list = [{"role": "user", "content": row["prompt"]}]
    for follow in (True, False):
        content, calls, logprobs, finish = "", [], [], None
        stream = await c.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, logprobs=True, stream=True
        )
        async for chunk in stream:
            choice = chunk.choices[0]
            content += choice.delta.content or ""
            calls += [call.model_dump() for call in choice.delta.tool_calls or []]
            logprobs += [t.logprob for t in (choice.logprobs.content if choice.logprobs else None) or []]
            finish = choice.finish_reason or finish
        LOG.setdefault(api_key, []).append({"content": content, "calls": calls, "logprobs": logprobs, "finish": finish})
        if not follow:
            break
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": str(arguments["a"] + arguments["b"])}
            )
    return 1.0


def _check_trajectory(sample, tokenizer) -> list[int]:
    """The episode is one trajectory: both turns' sampled ids, the tool result between them masked."""
    sampled = [tokenizer.convert_tokens_to_ids(t) for t in GOOD] + [tokenizer.eos_token_id]
    inserted = tokenizer.encode("t:<tool_response>7</tool_response>>a:", add_special_tokens=False)
    assert sample.info["calls"] == 2 and sample.info["trajectories"] == 1
    assert sample.info["history_mismatches"] == 0
    assert sample.prompt_ids == tokenizer.encode("<s>s:add(a,b)>u:3+4>a:", add_special_tokens=False)
    assert sample.response_ids == sampled + inserted + sampled
    assert sample.token_mask == [1] * len(sampled) + [0] * len(inserted) + [1] * len(sampled)
    return sampled


@pytest.mark.parametrize("previous", [False, True], ids=["whole_input", "previous_response_id"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_responses_continue_the_trajectory(run_wave, tokenizer, monkeypatch, previous, stream) -> None:
    import proxy_agents

    async def agent(base_url: str, api_key: str, row: dict) -> float:
        return await _responses_agent(base_url, api_key, row, previous=previous, stream=stream)

    monkeypatch.setattr(proxy_agents, "responses_agent", agent, raising=False)
    LOG.clear()
    wave, _ = run_wave(ROWS, n=2, program=f"{AGENTS}:responses_agent", **OPTIONS)
    (group,) = wave.groups
    for sample in group:
        sampled = _check_trajectory(sample, tokenizer)
        first, second, logged = LOG[sample.info["session"]]
        events = logged["events"]
        for response in (first, second):
            assert response["status"] == "completed" and response["object"] == "response"
            message, call = response["output"]
            assert message["type"] == "message" and message["content"][0]["text"] == "let me add."
            assert call["type"] == "function_call" and call["name"] == "add"
            assert json.loads(call["arguments"]) == {"a": 3, "b": 4} and call["call_id"].startswith("call_")
            assert response["usage"]["output_tokens"] == len(sampled)
            logprobs = [t["logprob"] for t in message["content"][0]["logprobs"]]
            assert logprobs == pytest.approx(sample.logprobs[: len(logprobs)])
        if stream:
            assert events[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
            assert "response.output_text.delta" in events and "response.function_call_arguments.done" in events
            assert events[-1] == "response.completed"


def test_streamed_chat_records_what_plain_chat_does(run_wave, tokenizer, monkeypatch) -> None:
    import proxy_agents

    monkeypatch.setattr(proxy_agents, "streamed_chat", _streamed_chat, raising=False)
    LOG.clear()
    wave, _ = run_wave(ROWS, n=2, program=f"{AGENTS}:streamed_chat", **OPTIONS)
    (group,) = wave.groups
    for sample in group:
        sampled = _check_trajectory(sample, tokenizer)
        for turn, offset in zip(LOG[sample.info["session"]], (0, len(sample.response_ids) - len(sampled))):
            assert turn["content"] == "let me add." and turn["finish"] == "tool_calls"
            (call,) = turn["calls"]
            assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 3, "b": 4}
            # the streamed log-probs are the recorded ones (the content's tokens, without the stop token)
            assert turn["logprobs"] == pytest.approx(sample.logprobs[offset : offset + len(sampled) - 1])
