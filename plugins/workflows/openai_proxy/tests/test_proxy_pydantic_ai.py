"""pydantic-ai (PyPI ``pydantic-ai-slim[openai]`` 2.68) through the proxy, for real: the
calculator agent (pydantic_calculator_agent.py) runs as a script from an environment of its own,
which the workflow builds from ``rollout.workflow.requirements`` with uv. In front: the real ``hf``
engine on the scripted tiny tool-calling model (it answers with ``let me add.`` and a hermes call
of ``add(3, 4)``).

- with ``OpenAIChatModel`` (chat completions) and ``OpenAIResponsesModel`` (the Responses API),
  each through ``Agent.run`` and ``Agent.run_stream``: the episode is the one sampled turn,
  pydantic-ai ran ``add`` as its output function (``ToolOutput``: the call ends the run) and its
  answer (the tool's result) earns reward 1;
- with ``add`` an ordinary tool, the agent asks the model again after the result (its second call
  carries the call and the tool's result, and continues the first trajectory) until the run's
  ``request_limit``: pydantic-ai's ``UsageLimitExceeded`` ends that episode, scored
  ``error_reward``, the other episodes unaffected;
- core-rl's own environment is unchanged (``pip list`` before and after building pydantic-ai's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from proxy_agents import SCRIPTED_TOOL_CALL, framework_options, framework_python, scripted_tool_model

HERE = Path(__file__).resolve().parent
AGENT = str(HERE / "pydantic_calculator_agent.py")
PYDANTIC_AI = ["pydantic-ai-slim[openai]==2.68.*"]
GOOD = SCRIPTED_TOOL_CALL
OPTIONS = framework_options(AGENT, PYDANTIC_AI)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return scripted_tool_model(tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def agent_python() -> str:
    """pydantic-ai's environment (built once, then reused), and core-rl's unchanged by it."""
    return framework_python(PYDANTIC_AI, "pydantic_ai", "pydantic-ai-slim", "2.68")


@pytest.mark.parametrize("model_kind", ["chat", "responses"])
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_stream"])
def test_the_pydantic_ai_calculator_agent_trains_through_the_proxy(
    run_wave, tokenizer, agent_python, model_kind, streamed
):
    rows = [{"prompt": "3+4", "answer": "7", "model": model_kind, "streamed": streamed}]
    wave, workflow = run_wave(rows, n=2, **OPTIONS)
    assert workflow.program.python == agent_python
    (group,) = wave.groups
    sampled = [tokenizer.convert_tokens_to_ids(t) for t in GOOD] + [tokenizer.eos_token_id]
    for sample in group:
        assert sample.info["calls"] == 1 and sample.info["trajectories"] == 1, sample.info.get("output")
        # the agent's tool and instructions (a system message), the question, as the template renders them
        prompt = tokenizer.encode("<s>s:add(a,b)>s:add>u:3+4>a:", add_special_tokens=False)
        assert sample.prompt_ids == prompt
        assert sample.response_ids == sampled and sample.token_mask == [1] * len(sampled)
        assert sample.reward == 1.0, sample.info.get("output")
        assert "answer 7" in sample.info["output"]


@pytest.mark.parametrize("model_kind", ["chat", "responses"])
def test_usage_limit_exceeded_ends_the_episode(run_wave, agent_python, model_kind) -> None:
    rows = [
        {"prompt": "3+4", "answer": "7", "model": model_kind},
        {"prompt": "3+4", "answer": "7", "model": model_kind, "stop_on_tool": False},  # asks again
    ]
    wave, _ = run_wave(rows, n=2, error_reward=-1.0, **OPTIONS)
    good, bad = wave.groups
    assert [s.reward for s in good] == [1.0, 1.0] and all("error" not in s.info for s in good)
    for sample in bad:
        assert sample.reward == -1.0 and sample.info["error"] == "UsageLimitExceeded"
        assert "UsageLimitExceeded" in sample.info["output"]
        # the two calls made before the limit: one trajectory, the result between them unmasked
        assert sample.info["calls"] == 2 and sample.info["trajectories"] == 1, sample.info
        assert 0 in sample.token_mask and sample.token_mask.count(1) == 2 * (len(GOOD) + 1)
