"""``data.chat_template`` (:mod:`core_rl.rollout.chat_template_override`): a run renders its prompts with the
given template instead of the tokenizer's (which here has none), its exports carry it, and a
template that is missing, unreadable as Jinja or set without the chat template is one error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from core_rl.rollout.chat_template_override import template_text
from core_rl.testing import preloaded

#: renders with the tiny tokenizer's characters only
TEMPLATE = "{% for m in messages %}q:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} a:{% endif %}"


def test_a_template_is_inline_jinja_or_a_file(tmp_path: Path) -> None:
    assert template_text(TEMPLATE, "data.chat_template") == (TEMPLATE, None)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert template_text(str(tmp_path / "t.jinja"), "data.chat_template") == (TEMPLATE, None)
    text, problem = template_text(str(tmp_path / "missing.jinja"), "data.chat_template")
    assert (
        text is None and problem.startswith("data.chat_template: ") and "neither a Jinja template nor a file" in problem
    )


pytest.importorskip("core_rl_fsdp")
pytest.importorskip("core_rl_hf")
pytest.importorskip("core_rl_grpo")
pytest.importorskip("core_rl_reward_match")


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from core_rl.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("chat-template")
    model = build_tiny_model(root / "model", seed=0)
    data = root / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": p}], "answer": p[::-1]} for p in ("ab", "cd", "ef", "gh")]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))  # conversations: samples show the rendering
    return model, data


def _train(tmp_path: Path, task: tuple[Path, Path], *overrides: str) -> subprocess.CompletedProcess[str]:
    from core_rl.testing.launch import write_grpo_config

    model, data = task
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    path = write_grpo_config(
        tmp_path,
        model,
        [str(data)],
        data={"train_files": [str(data)], "batch_size": 2, "apply_chat_template": True, "chat_template": "chat.jinja"},
        trainer={"total_steps": 1},
        sample_log={"every_n_steps": 1, "num_samples": 4},
    )
    return preloaded.run(
        [sys.executable, "-m", "core_rl.cli", "train", str(path), *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # the template's path is relative to the working directory
    )


def test_a_run_renders_its_prompts_with_the_template_and_exports_it(tmp_path: Path, task) -> None:
    from transformers import AutoTokenizer

    out = _train(tmp_path, task)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "runs" / "run"
    prompts = {json.loads(line)["prompt"] for line in (run / "samples.jsonl").open()}
    assert prompts and prompts <= {"q:ab a:", "q:cd a:", "q:ef a:", "q:gh a:"}, prompts
    assert (run / "final_hf" / "chat_template.jinja").read_text() == TEMPLATE
    exported = AutoTokenizer.from_pretrained(run / "final_hf")
    assert exported.apply_chat_template(
        [{"role": "user", "content": "ab"}], add_generation_prompt=True, tokenize=False
    ) == ("q:ab a:")
    assert not (Path(task[0]) / "chat_template.jinja").exists()  # the model directory is left as it was
    assert "# derived:" in next(line for line in (run / "config.yaml").open() if "tokenizer_path" in line)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.apply_chat_template=false", "data.chat_template: applies only with the chat template"),
        (
            "data.chat_template=missing.jinja",
            "data.chat_template: 'missing.jinja' is neither a Jinja template nor a file",
        ),
        (
            "data.chat_template='{% for m in messages %}'",
            "data.chat_template: the template cannot render a user message",
        ),
    ],
)
def test_a_template_the_run_cannot_use_is_one_error(tmp_path: Path, task, override: str, message: str) -> None:
    out = _train(tmp_path, task, override)
    assert out.returncode == 2, out.stderr[-3000:]
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
