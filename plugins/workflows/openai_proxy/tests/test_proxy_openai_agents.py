"""The openai-agents SDK (PyPI ``openai-agents`` 0.24) through the proxy, for real: the calculator
agent (sdk_calculator_agent.py) runs as a script from an environment of its own, which the
workflow builds from ``rollout.workflow.requirements`` with uv (installing the SDK into core-rl's
environment would change its packages: ``uv pip install --dry-run openai-agents`` downgrades
``websockets``). In front: the real ``hf`` engine on the scripted tiny tool-calling model (it
answers with ``let me add.`` and a hermes call of ``add(3, 4)``).

- with the SDK's default model (Responses API) and with chat completions, each through
  ``Runner.run`` and ``Runner.run_streamed``: the episode is the one sampled turn, the SDK ran
  the tool and its answer (the tool's result) earns reward 1;
- an agent that asks the model again after each result hits ``max_turns``: the SDK's
  ``MaxTurnsExceeded`` ends that episode, scored ``error_reward``, its kind and the script's
  output kept on the samples, the other episodes unaffected;
- core-rl's own environment is unchanged (``pip list`` before and after building the SDK's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from core_rl.testing import preloaded
from proxy_agents import SCRIPTED_TOOL_CALL, framework_options, framework_python, scripted_tool_model

HERE = Path(__file__).resolve().parent
AGENT = str(HERE / "sdk_calculator_agent.py")
SDK = ["openai-agents==0.24.*"]
GOOD = SCRIPTED_TOOL_CALL
OPTIONS = framework_options(AGENT, SDK)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return scripted_tool_model(tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def sdk_python() -> str:
    """The SDK's environment (built once, then reused), and core-rl's unchanged by it."""
    return framework_python(SDK, "agents", "openai-agents", "0.24")


@pytest.mark.parametrize("model_kind", ["responses", "chat"])
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_the_sdk_calculator_agent_trains_through_the_proxy(run_wave, tokenizer, sdk_python, model_kind, streamed):
    rows = [{"prompt": "3+4", "answer": "7", "model": model_kind, "streamed": streamed}]
    wave, workflow = run_wave(rows, n=2, **OPTIONS)
    assert workflow.program.python == sdk_python
    (group,) = wave.groups
    sampled = [tokenizer.convert_tokens_to_ids(t) for t in GOOD] + [tokenizer.eos_token_id]
    for sample in group:
        assert sample.info["calls"] == 1 and sample.info["trajectories"] == 1
        # the SDK's tool and instructions (a system message), the question, as the template renders them
        prompt = tokenizer.encode("<s>s:add(a,b)>s:add>u:3+4>a:", add_special_tokens=False)
        assert sample.prompt_ids == prompt
        assert sample.response_ids == sampled and sample.token_mask == [1] * len(sampled)
        assert sample.reward == 1.0, sample.info.get("output")
        assert "answer '7'" in sample.info["output"]


def test_max_turns_exceeded_ends_the_episode(run_wave, sdk_python) -> None:
    rows = [
        {"prompt": "3+4", "answer": "7", "stop_on_tool": True},
        {"prompt": "3+4", "answer": "7", "stop_on_tool": False},  # asks again until max_turns
    ]
    wave, _ = run_wave(rows, n=2, error_reward=-1.0, **OPTIONS)
    good, bad = wave.groups
    assert [s.reward for s in good] == [1.0, 1.0] and all("error" not in s.info for s in good)
    for sample in bad:
        assert sample.reward == -1.0 and sample.info["error"] == "MaxTurnsExceeded"
        assert sample.info["max_error_fraction"] == 0.5 and "MaxTurnsExceeded" in sample.info["failed"]
        assert "MaxTurnsExceeded" in sample.info["output"]
        assert sample.info["calls"] == 2  # the calls made before the limit are kept


def test_dropped_errors_leave_the_group_and_are_counted(run_wave, sdk_python) -> None:
    rows = [{"prompt": "3+4", "answer": "7", "stop_on_tool": False}]
    # every episode errored: they are scored (a group needs samples) ...
    wave, _ = run_wave(rows, n=2, on_error="drop", **OPTIONS)
    assert [s.info["error"] for s in wave.groups[0]] == ["MaxTurnsExceeded"] * 2


def test_an_interpreter_given_by_path_runs_the_script(run_wave, sdk_python) -> None:
    options = {**OPTIONS, "requirements": [], "python": sdk_python}
    wave, workflow = run_wave([{"prompt": "3+4", "answer": "7"}], n=1, **options)
    assert workflow.program.python == sdk_python
    ((sample,),) = wave.groups
    assert sample.reward == 1.0 and "answer '7'" in sample.info["output"]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_the_agent_function_runs_in_one_worker_of_its_environment(run_wave, tokenizer, sdk_python, streamed) -> None:
    """``sdk_calculator_agent.py:episode`` with ``requirements``: the function runs in a worker
    process of the SDK's environment (imported once for the run), its return value the reward."""
    options = {**OPTIONS, "program": f"{AGENT}:episode"}
    rows = [{"prompt": "3+4", "answer": "7", "streamed": streamed}, {"prompt": "3+4", "answer": "8"}]
    wave, workflow = run_wave(rows, n=2, **options)
    assert workflow.program.worker_spec is not None and workflow.program.worker_spec.python == sdk_python
    right, wrong = wave.groups
    assert [s.reward for s in right] == [1.0, 1.0] and [s.reward for s in wrong] == [0.0, 0.0]
    assert all(s.info["calls"] == 1 and "error" not in s.info for s in right + wrong)


def test_environment_mistakes_are_config_errors(tmp_path) -> None:
    from core_rl.errors import ConfigError
    from core_rl_openai_proxy.config import OpenAIAgentConfig
    from core_rl_openai_proxy.workflow import OpenAIAgentWorkflow

    with pytest.raises(ConfigError, match=r"rollout.workflow.python: no interpreter at '/nowhere/bin/python'"):
        OpenAIAgentWorkflow(OpenAIAgentConfig(program=AGENT, python="/nowhere/bin/python"))
    config = tmp_path / "c.yaml"
    config.write_text(
        "rollout:\n  workflow: {name: openai_agent, program: 'pkg.mod:f', requirements: [openai-agents], "
        "python: /usr/bin/python3}\n"
    )
    core_rl = str(Path(sys.executable).with_name("core-rl"))
    proc = preloaded.run([core_rl, "config", "validate", str(config)], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "rollout.workflow.requirements: cannot be set with python" in proc.stderr
