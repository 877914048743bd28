"""The calculator agent written with the openai-agents SDK, run by the ``openai_agent`` workflow
from an environment of its own (``rollout.workflow.requirements``: the SDK is not installed in
core-rl's environment): as a script (this file), or as the function :func:`episode` in one worker
process for the run (``sdk_calculator_agent.py:episode``).

The row says how: ``model`` ``responses`` (the SDK's default model, the Responses API) or
``chat`` (chat completions); ``streamed``: ``Runner.run_streamed`` instead of ``Runner.run``;
``stop_on_tool``: the agent's answer is the first tool result (else the model is asked again after
each result, and with the scripted model, which always calls the tool, ``max_turns`` raises the
SDK's ``MaxTurnsExceeded``). Its reward, posted to the proxy: 1 when the answer is the sum.
"""

from __future__ import annotations

import asyncio
import json
import os

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def add(a: int, b: int) -> int:
    """a + b"""
    return a + b


async def episode(base_url: str, api_key: str, row: dict) -> float:
    """One episode against the proxy at ``base_url`` (session ``api_key``); returns the reward: 1
    when the agent's answer is the row's."""
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    kind = OpenAIResponsesModel if row.get("model", "responses") == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="calculator",
        instructions="add",
        tools=[add],
        model=kind(model="policy", openai_client=client),
        tool_use_behavior="stop_on_first_tool" if row.get("stop_on_tool", True) else "run_llm_again",
    )
    if row.get("streamed"):
        result = Runner.run_streamed(agent, row["prompt"], max_turns=2)
        async for _event in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, row["prompt"], max_turns=2)
    reward = 1.0 if str(result.final_output).strip() == row["answer"] else 0.0
    print(f"answer {result.final_output!r}, reward {reward}")
    return reward


async def main() -> None:
    """Script mode: the episode of ``CORE_RL_ROW``, its reward posted to the proxy."""
    base_url, api_key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    reward = await episode(base_url, api_key, json.loads(os.environ["CORE_RL_ROW"]))
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.post(f"/sessions/{api_key}/reward", body={"reward": reward}, cast_to=object)


if __name__ == "__main__":
    asyncio.run(main())
