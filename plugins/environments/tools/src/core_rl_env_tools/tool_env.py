"""Tool environments: each model turn either calls tools (the environment answers with their
results, as the next observation) or answers (the answer is scored by a reward and the trajectory
ends). The reward-as-environment wrapper is the same without tools."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from core_rl.interfaces import Reward
from core_rl.protocol import RewardInput
from core_rl.rollout import Action, Environment, StepResult, ToolCall, ToolParser

#: a tool: its call's arguments -> its result text (raises ValueError on a bad call)
Tool = Callable[[Mapping[str, Any]], Awaitable[str]]


async def score_answer(reward: Reward, row: Mapping[str, Any], action: Action, text: str) -> float:
    """``reward``'s score of ``text`` as the answer to ``row`` (scored off the event loop)."""
    item = RewardInput(
        prompt_text=action.prompt_text,
        response_text=text,
        prompt_ids=list(action.prompt_ids),
        response_ids=list(action.token_ids),
        row=row,
        finish_reason="stop",
    )
    (score,) = await asyncio.to_thread(reward.score, [item])
    return float(score)


class RewardEnvironment(Environment):
    """One turn: the model's answer is scored by ``reward``; done."""

    def __init__(self, reward: Reward) -> None:
        self.reward = reward
        self.row: Mapping[str, Any] = {}

    async def reset(self, row: Mapping[str, Any]) -> str:
        self.row = row
        return ""

    async def step(self, action: Action) -> StepResult:
        return StepResult("", await score_answer(self.reward, self.row, action, action.text), True, {})


class ToolEnvironment(Environment):
    """A turn with tool calls gets their results (``result_format``, or ``error_format`` for a
    malformed or failing call) and goes on; a turn without any is the answer, scored by ``reward``."""

    def __init__(self, tools: Mapping[str, Tool], parser: ToolParser, reward: Reward, config: Any) -> None:
        self.tools, self.parser, self.reward, self.config = dict(tools), parser, reward, config
        self.row: Mapping[str, Any] = {}

    async def reset(self, row: Mapping[str, Any]) -> str:
        self.row = row
        return ""

    async def step(self, action: Action) -> StepResult:
        parsed = self.parser.parse(action.text)
        if not parsed.calls and not parsed.errors:
            score = await score_answer(self.reward, self.row, action, parsed.content)
            return StepResult("", score, True, {"answer": parsed.content})
        lines = [self.config.error_format.format(error=e) for e in parsed.errors]
        calls = parsed.calls[: self.config.max_calls]
        lines += [await self._run(call) for call in calls]
        if len(parsed.calls) > len(calls):
            lines.append(self.config.error_format.format(error=f"only {self.config.max_calls} calls per turn"))
        return StepResult("".join(lines), 0.0, False, {"calls": len(calls), "errors": len(parsed.errors)})

    async def _run(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            return self.config.error_format.format(error=f"no tool {call.name!r} (tools: {', '.join(self.tools)})")
        try:
            return self.config.result_format.format(result=await tool(call.arguments))
        except ValueError as e:
            return self.config.error_format.format(error=e)


def single_argument(arguments: Mapping[str, Any], *names: str) -> str:
    """The text argument of a one-argument tool: the first of ``names`` present, else ``input``,
    else the only argument; ``ValueError`` otherwise."""
    for name in (*names, "input"):
        if name in arguments:
            return str(arguments[name])
    if len(arguments) == 1:
        return str(next(iter(arguments.values())))
    raise ValueError(f"expected one argument ({', '.join(names)}), got {sorted(arguments) or 'none'}")
