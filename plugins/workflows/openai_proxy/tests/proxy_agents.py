"""Agent programs the tests run through the proxy (plain OpenAI client code), and a tiny task."""

from __future__ import annotations

import asyncio
import json

import openai
from core_rl.testing import preloaded

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


#: the structured output :func:`structured_answers` asks for: one key, two allowed values
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


async def structured_answers(base_url: str, api_key: str, row: dict) -> float:
    """The row's question with structured output, twice: a chat call with ``response_format``
    (a JSON schema), then a Responses call continuing it with ``text.format``; each reply's text
    goes in ``LOG``. Reward: 1 when both replies parse as what the schema accepts."""
    c = client(base_url, api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    schema = {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    chat = await c.chat.completions.create(
        model="policy", messages=messages, max_tokens=40, response_format={"type": "json_schema", "json_schema": schema}
    )
    first = chat.choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
    response = await c.responses.create(
        model="policy", input=messages, max_output_tokens=40, text={"format": {"type": "json_schema", **schema}}
    )
    LOG[api_key] = [{"chat": first, "finish": chat.choices[0].finish_reason, "responses": response.output_text}]
    allowed = [{"answer": "yes"}, {"answer": "no"}]
    return float(all(json.loads(text) in allowed for text in (first, response.output_text)))


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


#: the scripted tiny tool-calling model's turn (test_proxy_openai_agents, test_proxy_pydantic_ai):
#: a line of text, then a hermes call of add(3, 4)
SCRIPTED_TOOL_CALL = ["let me add.", "<tool_call>", '{"name":"add","arguments":{"a":3,"b":4}}', "</tool_call>"]


def pip_freeze() -> str:
    """core-rl's environment as ``pip list --format=freeze`` prints it."""
    import sys

    return preloaded.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout


def framework_python(requirements: list[str], module: str, distribution: str, version: str) -> str:
    """The interpreter of an agent framework's own environment, built from ``requirements`` as
    ``rollout.workflow.requirements`` builds it (once, then reused): it imports ``module`` with
    ``distribution`` at ``version``, while core-rl's environment is unchanged and cannot import it."""
    import sys

    from core_rl_openai_proxy.agent_env import agent_python

    before = pip_freeze()
    python = agent_python("", requirements)
    assert python != sys.executable
    probe = f"import {module}, importlib.metadata as m; print(m.version({distribution!r}))"
    assert preloaded.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.startswith(version)
    assert pip_freeze() == before
    assert preloaded.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode != 0
    return python


def framework_options(program: str, requirements: list[str]) -> dict:
    """The workflow options of a framework's calculator agent run as a script from its own
    environment, in front of the scripted tool-calling model (:func:`scripted_tool_model`)."""
    return {
        "program": program,
        "requirements": requirements,
        "max_context_tokens": 400,
        "max_new_tokens": 8,
        "chat_template": TOOL_TEMPLATE,
        "timeout_s": 120,
    }


def scripted_tool_model(directory):
    """The tiny model whose every turn is :data:`SCRIPTED_TOOL_CALL`, written to ``directory``."""
    from core_rl.testing.scripted_model import build_scripted_model

    return build_scripted_model(directory, {":": SCRIPTED_TOOL_CALL})
