"""The proxy in front of the real ``hf`` engine on the real pretrained model (SmolLM2-135M-Instruct:
a BPE tokenizer whose merges cross the seams between turns, the ChatML template, ``<|im_end|>`` as
its end of turn; the ``real_model`` fixture), with a ChatML template that renders tools in the
Hermes style (``chatml_tools.jinja``: the model's own renders none) and the ``hermes`` parser.

An agent asks with ``tools``, sends back whatever the model answered (a tool call, parsed, gets a
``tool`` message with its result; plain text a user message), and asks again. Whatever the model
samples, the episode is one trajectory whose trained ids are the sampled ids exactly, and whose
inserted ids are what the template renders between the two calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from proxy_agents import LOG, TOOLS, client

TEMPLATE = Path(__file__).with_name("chatml_tools.jinja")
ROWS = [{"prompt": "What is 3 + 4? Use the add tool."}]


@pytest.fixture(scope="module")
def model(real_model: Path) -> Path:
    """The run_wave fixture's engine and tokenizer on the real model."""
    return real_model


async def _asks_twice(base_url: str, api_key: str, row: dict) -> float:
    c = client(base_url, api_key)
    messages: list = [{"role": "user", "content": row["prompt"]}]
    for follow in (True, False):
        response = await c.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, logprobs=True, extra_body={"return_token_ids": True}
        )
        LOG.setdefault(api_key, []).append({"response": response.model_dump(), "messages": list(messages)})
        if not follow:
            break
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
                result = str(int(arguments["a"]) + int(arguments["b"]))
            except (ValueError, KeyError, TypeError):
                result = "error: add takes two integers a and b"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Please call the add tool."})
    return 1.0


def test_a_real_model_episode_is_one_exact_trajectory(run_wave, tokenizer, monkeypatch) -> None:
    import proxy_agents

    monkeypatch.setattr(proxy_agents, "asks_twice", _asks_twice, raising=False)
    LOG.clear()
    wave, _ = run_wave(
        ROWS,
        n=3,
        program="proxy_agents:asks_twice",
        chat_template=str(TEMPLATE),
        max_context_tokens=1024,
        max_new_tokens=24,
    )
    (group,) = wave.groups
    template = TEMPLATE.read_text()
    assert len(group) == 3
    for sample in group:
        assert sample.info["calls"] == 2 and sample.info["trajectories"] == 1
        assert sample.info["history_mismatches"] == 0
        first, second = LOG[sample.info["session"]]
        first_ids = first["response"]["choices"][0]["token_ids"]
        second_ids = second["response"]["choices"][0]["token_ids"]
        prompt = tokenizer.apply_chat_template(
            first["messages"], tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert sample.prompt_ids == tokenizer.encode(prompt, add_special_tokens=False)
        assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
        second_prompt = second["response"]["choices"][0]["prompt_token_ids"]
        assert second_prompt[: len(sample.prompt_ids) + len(first_ids)] == sample.prompt_ids + first_ids
        inserted = second_prompt[len(sample.prompt_ids) + len(first_ids) :]
        # what the template renders after the first reply: the reply's close (when the model did not
        # end its turn itself), then the tool results or the user's nudge, then the generation prompt
        rendered = tokenizer.apply_chat_template(
            second["messages"], tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert rendered.endswith(tokenizer.decode(inserted)), tokenizer.decode(inserted)
        assert tokenizer.decode(inserted).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert sample.response_ids == first_ids + inserted + second_ids
        assert sample.token_mask == [1] * len(first_ids) + [0] * len(inserted) + [1] * len(second_ids)
        assert sample.logprobs[len(first_ids) : len(first_ids) + len(inserted)] == [0.0] * len(inserted)
        assert all(lp < 0 for lp in sample.logprobs[: len(first_ids)])
        reply = first["response"]["choices"][0]
        if reply["message"]["tool_calls"]:  # the hermes parser found a call in real sampled text
            assert reply["finish_reason"] == "tool_calls"
        else:  # plain text: the reply's content, nothing lost
            assert reply["message"]["content"] and reply["message"]["content"] in tokenizer.decode(first_ids)
