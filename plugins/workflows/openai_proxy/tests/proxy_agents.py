"""Agent programs the tests run through the proxy (plain OpenAI client code), and a tiny task."""

from __future__ import annotations

import asyncio
import json

import openai

#: the tiny tokenizer's chat template (see examples/agent_proxy/chat_template.jinja)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)

#: a chat template that renders tools (hermes-like: each assistant call in <tool_call> tags, each
#: tool result in <tool_response> tags); its generation prompt ends in ":"
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}s:{% for t in tools %}{{ t['function']['name'] }}"
    "({{ t['function']['parameters']['properties'] | list | join(',') }}){% endfor %}>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}a:{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "{{ eos_token }}{% elif m['role'] == 'tool' %}t:<tool_response>{{ m['content'] }}</tool_response>>"
    "{% else %}{{ m['role'][0] }}:{{ m['content'] }}>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]

#: what each session saw, by API key: the raw responses of its calls
LOG: dict[str, list[dict]] = {}
_clients: dict[str, openai.AsyncOpenAI] = {}


def client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    if base_url not in _clients:
        _clients[base_url] = openai.AsyncOpenAI(
            base_url=base_url, api_key="unset", max_retries=0, timeout=openai.Timeout(600, connect=60)
        )
    return _clients[base_url].with_options(api_key=api_key)


def tool_result(question: str) -> str:
    a, b = question.split("+")
    return str(int(a) + int(b))


async def three_turns(base_url: str, api_key: str, row: dict) -> float:
    """user question, reply, tool result, reply, user "ok", reply; reward: the row's number."""
    return await _turns(
        base_url,
        api_key,
        row,
        [{"role": "tool", "content": tool_result(row["prompt"])}, {"role": "user", "content": "ok"}],
    )


async def two_turns(base_url: str, api_key: str, row: dict) -> float:
    """user question, reply, tool result, reply; reward: the row's number."""
    return await _turns(base_url, api_key, row, [{"role": "tool", "content": tool_result(row["prompt"])}])


async def _turns(base_url: str, api_key: str, row: dict, follow_ups: list[dict]) -> float:
    """The row's question, then after each reply the next of ``follow_ups``; each call's response
    goes in ``LOG``."""
    c = client(base_url, api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    for follow_up in [*follow_ups, None]:
        response = await c.chat.completions.create(
            model="policy", messages=messages, max_tokens=5, logprobs=True, extra_body={"return_token_ids": True}
        )
        LOG.setdefault(api_key, []).append(response.model_dump())
        if follow_up is None:
            break
        # a refusal key and other extras of the returned message must not count as a history change
        messages += [response.choices[0].message.model_dump(exclude_none=True), follow_up]
    return float(row["reward"])


async def rewrites_history(base_url: str, api_key: str, row: dict) -> None:
    """Two calls, the second claiming the model said something else; the outcome goes in LOG."""
    c = client(base_url, api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    await c.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": "0000"}, {"role": "user", "content": "1"}]
    try:
        await c.chat.completions.create(model="policy", messages=messages)
        LOG.setdefault(api_key, []).append({"second": "ok"})
    except openai.BadRequestError as exc:
        LOG.setdefault(api_key, []).append({"second": exc.code})
    await c.post(f"/sessions/{api_key}/reward", body={"reward": 0.5}, cast_to=object)


async def one_call_then_hangs(base_url: str, api_key: str, row: dict) -> float:
    await client(base_url, api_key).chat.completions.create(model="policy", messages=[{"role": "user", "content": "1"}])
    await asyncio.sleep(3600)
    return 1.0


async def no_call(base_url: str, api_key: str, row: dict) -> float:
    return 1.0


async def uses_tools(base_url: str, api_key: str, row: dict) -> float:
    """Two calls with ``tools``: the reply goes back as the client returned it, then a ``tool``
    message per tool call (or, when the reply has none, a user message)."""
    c = client(base_url, api_key)
    messages: list = [{"role": "user", "content": row["prompt"]}]
    for follow in (True, False):
        response = await c.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, logprobs=True, extra_body={"return_token_ids": True}
        )
        LOG.setdefault(api_key, []).append(response.model_dump())
        if not follow:
            break
        message = response.choices[0].message
        messages.append(message)  # the message object itself, as OpenAI's examples do
        for call in message.tool_calls or []:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "again"})
    return 1.0


async def asks_for_repeats(base_url: str, api_key: str, row: dict) -> float:
    """One call whose penalties (OpenAI's two, vLLM's and SGLang's repetition penalty) would favour
    repeats if the proxy honoured them; the response goes in LOG."""
    response = await client(base_url, api_key).chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": row["prompt"]}],
        frequency_penalty=-2.0,
        presence_penalty=-2.0,
        extra_body={"repetition_penalty": 0.5, "return_token_ids": True},
    )
    LOG.setdefault(api_key, []).append(response.model_dump())
    return 1.0
