"""Text prompts for a chat model with ``data.apply_chat_template`` false: one warning at preflight,
on the real instruct model's tokenizer (SmolLM2-135M-Instruct, ChatML, EOS ``<|im_end|>``), and
none for a base model's tokenizer, prompts rendered beforehand, or the template turned on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from core_rl import cli
from core_rl.config.schema import DataConfig
from core_rl.data import prompts
from core_rl.data.files import DataRow
from core_rl.rollout.chat_template import ends_turns_with_eos
from core_rl.testing.launch import write_grpo_config
from core_rl.testing.tiny import build_tiny_model
from transformers import AutoTokenizer

pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")

WARNING = "core-rl: warning: data.apply_chat_template is false"


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the lines announced in its own calls (they print once per process)."""
    monkeypatch.setattr(prompts, "_ANNOUNCED", set())


def _validate(tmp_path: Path, model: Path, rows: list[dict[str, str]], *overrides: str) -> int:
    """``core-rl config validate --preflight`` of a small GRPO config on ``model`` and ``rows``."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = write_grpo_config(tmp_path, model, [str(data)])
    return cli.main(["config", "validate", "--preflight", str(path), *overrides])


def test_text_prompts_for_the_instruct_model_are_warned_of_once(real_model, tmp_path, capsys):
    rows = [{"prompt": f"What is {a} + 2?", "answer": str(a + 2)} for a in range(3)]
    status = _validate(tmp_path, real_model, rows)
    err = capsys.readouterr().err
    assert status == 0
    assert err.count(WARNING) == 1, err
    assert "'<|im_end|>'" in err and "set data.apply_chat_template: true" in err
    status = _validate(tmp_path, real_model, rows, "data.apply_chat_template=true")
    assert status == 0 and WARNING not in capsys.readouterr().err


def test_prompts_rendered_beforehand_are_not_warned_of(real_model, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    status = _validate(tmp_path, real_model, [{"prompt": rendered, "answer": "3"}, {"prompt": "2+2", "answer": "4"}])
    assert status == 0 and WARNING not in capsys.readouterr().err


def test_a_base_models_tokenizer_is_not_a_chat_models(real_model, tmp_path):
    """The same ChatML template with the document token as EOS (how Qwen2.5's base model ships it),
    a template that writes ``eos_token`` itself, and a tokenizer without a template."""
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    assert ends_turns_with_eos(tokenizer)
    rows = [DataRow(row={"prompt": "What is 1 + 2?"}, file="f", line=1)]
    config = DataConfig(train_files=["f"])
    assert prompts.raw_chat_prompts_warning(rows, config, tokenizer) is not None
    tokenizer.eos_token = "<|endoftext|>"
    assert not ends_turns_with_eos(tokenizer)
    assert prompts.raw_chat_prompts_warning(rows, config, tokenizer) is None
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert ends_turns_with_eos(tokenizer)
    tiny = build_tiny_model(tmp_path / "tiny", alphabet="abc=", hidden_size=16, num_heads=2)
    assert not ends_turns_with_eos(AutoTokenizer.from_pretrained(tiny))
