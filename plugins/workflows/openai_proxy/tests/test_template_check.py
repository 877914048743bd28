"""The chat template an agent's calls go through is checked before any model loads
(:mod:`core_rl_openai_proxy.template_check`): no template at all stops ``core-rl config validate
--preflight`` (exit status 2, one line naming ``rollout.workflow.chat_template``); a template that does
not render ``tools``, or a tool parser that does not read the calls the template writes, is a warning
naming the key to change; a template and parser that fit say nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from core_rl.config.checks import EnvironmentContext
from core_rl.config.schema import PluginSpec
from core_rl.testing import preloaded
from core_rl.testing.tiny import CHAT_TEMPLATE, build_tiny_model
from core_rl_openai_proxy.config import OpenAIAgentConfig
from core_rl_openai_proxy.template_check import template_findings
from proxy_agents import TOOL_TEMPLATE

HERE = Path(__file__).resolve().parent
CORE_RL = str(Path(sys.executable).with_name("core-rl"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("template") / "model", seed=0)


def _findings(model: Path, **options) -> tuple[list[str], list[str]]:
    config = OpenAIAgentConfig(program="agent.py", **options)
    run = SimpleNamespace(actor=SimpleNamespace(model_path=str(model), tokenizer_path=None, trust_remote_code=False))
    return template_findings(config, EnvironmentContext(path="rollout.workflow", run=run, name="openai_agent"))


def test_a_tokenizer_without_a_chat_template_is_a_problem_naming_the_key(model: Path) -> None:
    from transformers import AutoTokenizer

    assert not AutoTokenizer.from_pretrained(model).chat_template  # the tiny tokenizer ships none
    problems, warnings = _findings(model)
    assert warnings == []
    (line,) = problems
    assert line.startswith(f"rollout.workflow.chat_template: the tokenizer of {model} has no chat template")


def test_a_template_that_does_not_render_tools_is_a_warning(model: Path) -> None:
    problems, warnings = _findings(model, chat_template=CHAT_TEMPLATE)
    assert problems == []
    (line,) = warnings
    assert line.startswith("rollout.workflow.chat_template: the chat template does not render a request's 'tools'")


def test_a_template_and_parser_that_fit_say_nothing(model: Path) -> None:
    assert _findings(model, chat_template=TOOL_TEMPLATE) == ([], [])


def test_a_parser_that_does_not_read_the_templates_calls_is_a_warning_naming_it(model: Path) -> None:
    problems, warnings = _findings(model, chat_template=TOOL_TEMPLATE, tool_parser=PluginSpec(name="llama3_json"))
    assert problems == []
    (line,) = warnings
    assert line.startswith("rollout.workflow.tool_parser: 'llama3_json' does not read the tool calls")
    assert "<tool_call>" in line  # what the template writes is shown


def test_config_validate_preflight_stops_on_a_missing_template(model: Path, tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "3+4"}) + "\n")
    config = {
        "experiment": {"name": "t", "output_dir": str(tmp_path)},
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "batch_size": 1},
        "actor": {"model_path": str(model), "engine": {"name": "fsdp"}},
        "rollout": {
            "engine": {"name": "hf"},
            "sampling": {"n": 2, "max_new_tokens": 8},
            "workflow": {"name": "openai_agent", "program": str(HERE / "hanging_agent.py")},
        },
        "algorithm": {"name": "grpo"},
        "reward": {"name": "workflow"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = preloaded.run([CORE_RL, "config", "validate", "--preflight", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rollout.workflow.chat_template: the tokenizer of" in proc.stderr
    assert "Traceback" not in proc.stderr
    (tmp_path / "plain.jinja").write_text(CHAT_TEMPLATE)
    override = f"rollout.workflow.chat_template={tmp_path / 'plain.jinja'}"
    plain = preloaded.run(
        [CORE_RL, "config", "validate", "--preflight", str(path), override], capture_output=True, text=True
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr  # renders no tools: a warning, not a stop
    assert (
        "core-rl: warning: rollout.workflow.chat_template: the chat template does not render a request's 'tools'"
        in plain.stderr
    )
