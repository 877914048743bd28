"""Agent programs the tests run through the proxy (plain OpenAI client code), and a tiny task."""

from __future__ import annotations

import asyncio

import openai

#: the tiny tokenizer's chat template (see examples/agent_proxy/chat_template.jinja)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)

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
    c = client(base_url, api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    for follow_up in ({"role": "tool", "content": tool_result(row["prompt"])}, {"role": "user", "content": "ok"}, None):
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
