"""Conversations as prompts (:mod:`core_rl.rollout.chat_template`, ``data.apply_chat_template``,
``data.system_prompt``, ``data.chat_template_kwargs``): the rendering and the assistant-turn mask
by hand and as a property over random conversations, the data checks with their positions, the
configuration checks, and a GRPO run whose prompts are conversations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from core_rl.config import load_config
from core_rl.config.schema import DataConfig
from core_rl.data.prompts import check_rows, read_data_files, tokenisation_key, tokenise_rows
from core_rl.plugins.host import PluginHost
from core_rl.rollout.chat_template import conversation_problem, prompt_messages, render_conversation, render_prompt
from core_rl.testing.tiny import add_chat_template, build_tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

ALPHABET = "abc="  # of the contents; the tokenizer also has the template's "s", "u", ":" and ">"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_model(
        tmp_path_factory.mktemp("chat") / "m", alphabet=ALPHABET + "su:>", hidden_size=16, num_heads=2
    )
    add_chat_template(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _chars(tokenizer, ids: list[int]) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(ids))


def test_prompt_messages_put_the_system_prompt_first_once() -> None:
    assert prompt_messages("ab", None) == [{"role": "user", "content": "ab"}]
    assert prompt_messages("ab", "") == [{"role": "system", "content": ""}, {"role": "user", "content": "ab"}]
    own = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    assert prompt_messages(own, "z") == own  # a conversation's own system message stays, alone
    assert prompt_messages(own[1:], "z") == [{"role": "system", "content": "z"}, own[1]]


def test_a_prompt_renders_with_the_generation_prompt_and_the_templates_variables(tokenizer) -> None:
    messages = prompt_messages([{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}], "b")
    ids, text = render_prompt(tokenizer, messages, {})
    assert text == "<s>s:b>u:ab>a:c</s>a:" and _chars(tokenizer, ids) == "<s>s:b>u:ab>a:c</s>a:"
    assert render_prompt(tokenizer, messages, {"enable_thinking": False})[1].endswith("</s>a:==")


def test_the_assistant_mask_by_hand(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "c"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ba"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "=a"},
    ]
    ids, mask = render_conversation(tokenizer, messages, {})
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "".join(tokens) == "<s>s:c>u:ab>a:ba</s>u:c>a:=a</s>"
    # each assistant turn's content and its end of turn; never "a:" (the generation prompt)
    assert "".join(t if m else "." for t, m in zip(tokens, mask)) == "............ba</s>......=a</s>"


@settings(max_examples=40, deadline=None)
@given(
    turns=st.lists(st.tuples(st.text(ALPHABET, min_size=1, max_size=4), st.text(ALPHABET, max_size=4)), min_size=1),
    system=st.one_of(st.none(), st.text(ALPHABET, max_size=3)),
)
def test_the_mask_holds_exactly_the_assistant_turns(tokenizer, turns, system) -> None:
    """Random conversations: the masked tokens are the assistant contents, each with ``</s>``, in
    order, and the unmasked ones re-render the rest of the conversation."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    ids, mask = render_conversation(tokenizer, messages, {})
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "".join(tokens) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert "".join(t for t, m in zip(tokens, mask) if m) == "".join(f"{reply}</s>" for _, reply in turns)
    assert not mask[0]


def test_conversations_that_cannot_be_trained_on_say_why(tokenizer) -> None:
    user = {"role": "user", "content": "a"}
    with pytest.raises(ValueError, match="no assistant message"):
        render_conversation(tokenizer, [user], {})
    with pytest.raises(ValueError, match="starts with an assistant message"):
        render_conversation(tokenizer, [{"role": "assistant", "content": "a"}, user], {})
    # a template that drops earlier assistant turns (as templates that strip earlier reasoning do)
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['role'][0] }}:{{ m['content'] }}>"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
    )
    two_turns = [user, {"role": "assistant", "content": "b"}, user, {"role": "assistant", "content": "c"}]
    with pytest.raises(ValueError, match="up to message 1 .* differently .* one assistant turn per row"):
        render_conversation(tokenizer, two_turns, {})


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ([], "a non-empty list of messages"),
        (["hi"], "message 0 is not an object"),
        ([{"content": "a"}], "message 0 has no 'role'"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "message 1 (user) has no text 'content'"),
        ([{"role": "user", "content": "a"}], None),
    ],
)
def test_what_a_conversation_is(value, why) -> None:
    problem = conversation_problem(value)
    assert problem is None if why is None else why in problem


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_data_rows_of_conversations_are_checked_and_rendered(tmp_path, tokenizer) -> None:
    good = [{"role": "user", "content": "ab"}]
    path = _write(
        tmp_path / "d.jsonl",
        [{"prompt": good}, {"prompt": [{"role": "user"}]}, {"prompt": 3}, {"prompt": "ca"}],
    )
    rows, problems = read_data_files([str(path)])
    assert problems == []
    assert check_rows(rows, "prompt", {}, chat_template=True) == [
        f"{path}:2: column 'prompt': message 0 (user) has no text 'content'",
        f"{path}:3: column 'prompt' holds a number (3); prompts are text or a list of messages",
    ]
    assert check_rows(rows[:1], "prompt", {}) == [
        f"{path}:1: column 'prompt' holds a conversation (a list of messages), which only the chat template can "
        "render; set data.apply_chat_template: true"
    ]
    config = DataConfig(apply_chat_template=True, system_prompt="c", chat_template_kwargs={"enable_thinking": False})
    items, problems = tokenise_rows([rows[0], rows[3]], config, tokenizer)
    assert problems == []
    # a conversation's text is its rendering; text stays the text, rendered as the user turn
    assert [item.text for item in items] == ["<s>s:c>u:ab>a:==", "ca"]
    assert [_chars(tokenizer, item.prompt_ids) for item in items] == ["<s>s:c>u:ab>a:==", "<s>s:c>u:ca>a:=="]
    plain = tokenisation_key(DataConfig(apply_chat_template=True), tokenizer)
    assert tokenisation_key(config, tokenizer) != plain  # the system prompt and the variables change the items


def _run_config(tmp_path: Path, model: Path, data: Path, **data_keys) -> Path:
    config = {
        "experiment": {"name": "chat", "output_dir": str(tmp_path / "runs")},
        "data": {"train_files": [str(data)], "batch_size": 2, **data_keys},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}, "optimizer": {"lr": 1e-3}},
        "rollout": {"engine": {"name": "hf"}, "sampling": {"n": 2, "max_new_tokens": 3}},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "exact_match"},
        "trainer": {"total_steps": 2, "torch_threads": 1},
        "loggers": [{"name": "jsonl"}],
        "saver": {"every_n_steps": 0, "at_end": False},
        "sample_log": {"every_n_steps": 1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_settings_need_the_chat_template_and_take_only_template_variables(tmp_path, model) -> None:
    from core_rl.errors import ConfigError

    data = _write(tmp_path / "d.jsonl", [{"prompt": "ab", "answer": "a"}])
    path = _run_config(tmp_path, model, data)
    with pytest.raises(ConfigError) as info:
        load_config(
            path,
            ["data.system_prompt=be brief", "data.chat_template_kwargs={enable_thinking: false}"],
            host=PluginHost(),
        )
    assert info.value.problems == [
        "data.system_prompt: applies only with the chat template; set data.apply_chat_template: true",
        "data.chat_template_kwargs: applies only with the chat template; set data.apply_chat_template: true",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(
            path, ["data.apply_chat_template=true", "data.chat_template_kwargs={tokenize: false}"], host=PluginHost()
        )
    assert info.value.problems == [
        "data.chat_template_kwargs: tokenize is an argument core-rl sets itself, not a template variable; remove it"
    ]


pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


def test_a_grpo_run_on_conversations(tmp_path, model, capsys) -> None:
    """Preflight renders the conversations (a bad one is refused with its line and exit 2), and a
    run generates after each rendered conversation, which the sample log shows as the prompt."""
    from core_rl import cli

    rows = [
        {
            "prompt": [
                {"role": "user", "content": s},
                {"role": "assistant", "content": "="},
                {"role": "user", "content": "b"},
            ],
            "answer": s,
        }
        for s in ("ab", "ca", "bcb", "a")
    ]
    data = _write(tmp_path / "conv.jsonl", rows)
    path = _run_config(tmp_path, model, data, apply_chat_template=True, system_prompt="")
    assert cli.main(["config", "validate", "--preflight", str(path)]) == 0
    capsys.readouterr()
    bad = _write(tmp_path / "bad.jsonl", [*rows, {"prompt": [{"role": "user", "content": 1}], "answer": "a"}])
    assert cli.main(["config", "validate", "--preflight", str(path), f"data.train_files=[{bad}]"]) == 2
    assert f"{bad}:5: column 'prompt': message 0 (user) has no text 'content'" in capsys.readouterr().err
    assert cli.main(["train", str(path)]) == 0
    samples = [json.loads(line) for line in (tmp_path / "runs" / "chat" / "samples.jsonl").read_text().splitlines()]
    prompts = {s["prompt"] for s in samples}
    assert prompts <= {f"<s>s:>u:{s}>a:=</s>u:b>a:" for s in ("ab", "ca", "bcb", "a")} and prompts
