"""The tools themselves: the calculator's arithmetic (hypothesis against Python's integers), its
refusals, the observations a tool environment writes, and the python tool in the real sandbox."""

from __future__ import annotations

import asyncio
import json

import core_rl_env_tools.plugin as plugin
import pytest
from core_rl.config.schema import PluginSpec
from core_rl.rollout.environments import Action
from core_rl.rollout.tool_parsers import HermesConfig, HermesParser
from core_rl_env_tools.calculator import CalculatorError, calculate
from core_rl_env_tools.config import ToolEnvConfig
from core_rl_env_tools.tool_env import ToolEnvironment
from hypothesis import given
from hypothesis import strategies as st

ints = st.integers(-(10**12), 10**12)


@given(ints, ints, ints)
def test_integer_arithmetic_matches_python(a: int, b: int, c: int) -> None:
    assert calculate(f"{a}+{b}") == str(a + b)
    assert calculate(f"({a})*({b})-({c})") == str(a * b - c)
    if b:
        assert calculate(f"({a})//({b})") == str(a // b)
        assert calculate(f"({a})%({b})") == str(a % b)


def test_decimals_and_refusals() -> None:
    assert calculate("1/4") == "0.25" and calculate("2/3") == "0.666667" and calculate("2**10") == "1024"
    assert calculate(" 7 ") == "7" and calculate("-(3)") == "-3" and calculate("0.1+0.2") == "0.3"
    for bad in ("1/0", "__import__('os')", "a+1", "2**0.5", "9**9**9", "1+", "[1]"):
        with pytest.raises(CalculatorError):
            calculate(bad)


class Answers:
    """A stand-in reward (the real ones are in the conformance tests): 1.0 for the text 'ok'."""

    def score(self, items):
        return [float(item.response_text == "ok") for item in items]


def step(env: ToolEnvironment, text: str):
    return asyncio.run(env.step(Action(text, (), 0, "")))


def test_observations_of_a_tool_environment() -> None:
    env = ToolEnvironment(
        {"calculator": plugin.calculator},
        HermesParser(HermesConfig()),
        Answers(),
        ToolEnvConfig(reward=PluginSpec(name="answers")),
    )
    asyncio.run(env.reset({}))
    call = json.dumps({"name": "calculator", "arguments": {"expression": "6*7"}})
    assert step(env, f"<tool_call>{call}</tool_call>") == (
        "<tool_response>42</tool_response>",
        0.0,
        False,
        {"calls": 1, "errors": 0},
    )
    unknown = step(env, '<tool_call>{"name": "web", "arguments": {}}</tool_call>')
    assert unknown.observation == "<tool_response>error: no tool 'web' (tools: calculator)</tool_response>"
    refused = step(env, '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>')
    assert refused.observation == "<tool_response>error: division by zero</tool_response>" and not refused.done
    assert step(env, "<tool_call>{oops</tool_call>").observation.startswith("<tool_response>error: tool call")
    many = step(env, f"<tool_call>{call}</tool_call>" * 6)
    assert many.observation.count("42") == 4 and many.observation.endswith("only 4 calls per turn</tool_response>")
    assert step(env, "ok") == ("", 1.0, True, {"answer": "ok"})


def test_the_python_tool_runs_in_the_sandbox() -> None:
    sandbox = pytest.importorskip("core_rl_reward_code.sandbox")
    if sandbox.sandbox_problem() is not None:
        pytest.skip(sandbox.sandbox_problem())
    from core_rl_env_tools.python_tool import make_python_tool

    tool = make_python_tool(timeout_s=2.0, memory_mb=256)
    assert asyncio.run(tool({"code": "import os\nprint(os.getuid() != 0 or 'root', 6 * 7)"})).endswith("42")
    assert "ZeroDivisionError" in asyncio.run(tool({"code": "1/0"}))
    with pytest.raises(ValueError, match="ran past"):
        asyncio.run(tool({"code": "while True: pass"}))
