"""Reasoning apart from the answer (``reasoning_tags``): by hand, and over real HTTP with the real
``openai`` client in front of the real ``hf`` engine on a scripted tiny model that reasons, then
calls a tool. The reasoning comes back as ``message.reasoning_content``, the answer as ``content``
with its tool call parsed from it; the client's follow-up without the reasoning continues the
trajectory on the sampled ids."""

from __future__ import annotations

import json

import pytest
from core_rl.errors import ConfigError
from core_rl_openai_proxy.reasoning import split_reasoning
from proxy_agents import LOG, TOOL_TEMPLATE

CALL = '{"name":"add","arguments":{"a":3,"b":4}}'
THINKS = ["<think>", "sum it", "</think>", "let me add.", "<tool_call>", CALL, "</tool_call>"]
TAGS = ["<think>", "</think>"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think> a b </think>\n\nanswer", ("a b", "answer")),
        ("a b</think>answer", ("a b", "answer")),  # the opening tag was in the prompt (DeepSeek-R1)
        ("<think>cut off", ("cut off", "")),  # still reasoning when the budget ran out
        ("just an answer", (None, "just an answer")),
        ("<think>x</think>", ("x", "")),
    ],
)
def test_split_by_hand(text: str, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, TAGS) == expected
    assert split_reasoning(text, None) == (None, text)


def test_the_tags_are_checked() -> None:
    from core_rl.config.loader import structure
    from core_rl_openai_proxy.config import OpenAIAgentConfig

    with pytest.raises(ConfigError, match=r"reasoning_tags: must be \[opening, closing\]"):
        structure({"program": "a.py", "reasoning_tags": ["<think>"]}, OpenAIAgentConfig, path="rollout.workflow")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from core_rl.testing.scripted_model import build_scripted_model

    return build_scripted_model(tmp_path_factory.mktemp("reasoning") / "model", {":": THINKS})


def test_reasoning_comes_back_apart_and_the_trajectory_continues(run_wave, tokenizer) -> None:
    LOG.clear()
    options = {"program": "proxy_agents:uses_tools", "max_context_tokens": 400, "max_new_tokens": 10}
    wave, _ = run_wave([{"prompt": "3+4"}], n=1, chat_template=TOOL_TEMPLATE, reasoning_tags=TAGS, **options)
    ((sample,),) = wave.groups
    assert sample.info["calls"] == 2 and sample.info["history_mismatches"] == 0
    sampled = [tokenizer.convert_tokens_to_ids(t) for t in THINKS] + [tokenizer.eos_token_id]
    for call in LOG[sample.info["session"]]:
        choice = call["choices"][0]
        assert choice["message"]["reasoning_content"] == "sum it"
        assert choice["message"]["content"] == "let me add." and choice["finish_reason"] == "tool_calls"
        (tool_call,) = choice["message"]["tool_calls"]
        assert json.loads(tool_call["function"]["arguments"]) == {"a": 3, "b": 4}
        assert choice["token_ids"] == sampled  # the trajectory keeps what was sampled, reasoning included
    assert sample.response_ids[: len(sampled)] == sampled and sample.response_ids[-len(sampled) :] == sampled
