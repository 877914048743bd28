"""The calculator agent written with pydantic-ai (PyPI ``pydantic-ai-slim[openai]``), run as a
script by the ``openai_agent`` workflow from an environment of its own
(``rollout.workflow.requirements``: pydantic-ai is not installed in core-rl's environment).

The row says how: ``model`` ``chat`` (``OpenAIChatModel``, chat completions) or ``responses``
(``OpenAIResponsesModel``, the Responses API), each on an ``OpenAIProvider`` at the proxy;
``streamed``: ``Agent.run_stream`` instead of ``Agent.run``; ``stop_on_tool`` (default): the tool
``add`` is the agent's output function (``ToolOutput``: the model's call of it ends the run, its
result the answer; pydantic-ai's way to stop at a tool), else ``add`` is an ordinary tool and the
model is asked again after each result (with the scripted model, which always calls the tool, the
run's ``request_limit`` of 2 raises pydantic-ai's ``UsageLimitExceeded``). Its reward, posted to
the proxy: 1 when the answer is the row's ``answer``.
"""

from __future__ import annotations

import asyncio
import json
import os

from openai import AsyncOpenAI
from pydantic_ai import Agent, ToolOutput
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits


def add(a: int, b: int) -> int:
    """a + b"""
    return a + b


async def main() -> None:
    base_url, api_key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    row = json.loads(os.environ["CORE_RL_ROW"])
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    kind = OpenAIResponsesModel if row.get("model", "chat") == "responses" else OpenAIChatModel
    model = kind("policy", provider=OpenAIProvider(openai_client=client))
    if row.get("stop_on_tool", True):
        agent = Agent(model, instructions="add", output_type=ToolOutput(add, name="add", description="a + b"))
    else:
        agent = Agent(model, instructions="add", tools=[add])
    limits = UsageLimits(request_limit=2)
    if row.get("streamed"):
        async with agent.run_stream(row["prompt"], usage_limits=limits) as result:
            async for _output in result.stream_output():
                pass
            output = await result.get_output()
    else:
        output = (await agent.run(row["prompt"], usage_limits=limits)).output
    reward = 1.0 if str(output).strip() == row["answer"] else 0.0
    print(f"answer {output!r}, reward {reward}")
    await client.post(f"/sessions/{api_key}/reward", body={"reward": reward}, cast_to=object)


if __name__ == "__main__":
    asyncio.run(main())
