"""Plugins that block on purpose, for the deadline tests (:mod:`core_rl.reliability.deadlines`,
:mod:`core_rl.reliability.own_loop`): each makes a blocking call (``time.sleep``) that no timeout of its own
ends, at a chosen call of its process, as a plugin author's mistake would. Registered by
:class:`core_rl.testing.faults.FaultPlugin` (``python -m core_rl.testing.faults train ...``):

- reward ``block``: ``time.sleep(seconds)`` in its ``call``-th ``score`` call (1-based, counted per
  process); other calls score each item ``len(response) / 10``.
- environment ``block``: ``async def step`` calls ``time.sleep(seconds)`` (blocking its event
  loop; with ``awaiting: true`` it awaits ``asyncio.sleep(seconds)`` instead, a hang that leaves
  the loop free) from its ``from_call``-th step of the process on; other steps pay 1 and end the
  trajectory.
- sample filter ``block``: ``time.sleep(seconds)`` in its ``call``-th call; other calls keep every sample.
- logger ``block``: ``time.sleep(seconds)`` in its ``log`` of step ``step``.
- workflow ``block``: single-turn (one ``generate`` of the row's prompt), but its ``call``-th
  ``async def run`` of the process calls ``time.sleep(seconds)``, blocking the rollout controller's loop.

:func:`in_environment` turns a run configuration of the tiny task into one driving the ``block``
environment.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from core_rl.interfaces import Logger, Reward, SampleFilter
from core_rl.rollout.environments import Action, Environment, StepResult
from core_rl.rollout.workflows import RolloutWorkflow, WorkflowContext

#: a day: longer than any test waits
DAY_S = 86400.0


@attrs.define
class BlockOnCallConfig:
    """``call``: the 1-based call of the process that blocks; ``seconds``: how long it sleeps."""

    call: int = 3
    seconds: float = DAY_S


class BlockingReward(Reward):
    """See the module docstring."""

    _calls = itertools.count(1)

    def __init__(self, config: BlockOnCallConfig) -> None:
        self.config = config

    def score(self, items: Sequence[Any]) -> list[float]:
        if next(BlockingReward._calls) == self.config.call:
            time.sleep(self.config.seconds)
        return [len(item.response_text) / 10 for item in items]


@attrs.define
class BlockingEnvironmentConfig:
    """``from_call``: the 1-based step call of the process from which every step blocks;
    ``awaiting``: await the sleep instead of blocking the loop."""

    from_call: int = 1
    seconds: float = 10.0**6
    awaiting: bool = False


class BlockingEnvironment(Environment):
    """See the module docstring."""

    _steps = itertools.count(1)

    def __init__(self, config: BlockingEnvironmentConfig) -> None:
        self.config = config

    async def reset(self, row: Mapping[str, Any]) -> str:
        return ""

    async def step(self, action: Action) -> StepResult:
        if next(BlockingEnvironment._steps) >= self.config.from_call:
            if self.config.awaiting:
                await asyncio.sleep(self.config.seconds)
            else:
                time.sleep(self.config.seconds)  # blocks the event loop it runs on: the mistake under test
        return StepResult("", 1.0, True, {})


class BlockingFilter(SampleFilter):
    """See the module docstring."""

    _calls = itertools.count(1)

    def __init__(self, config: BlockOnCallConfig) -> None:
        self.config = config

    def __call__(self, batch: Any) -> Any:
        import torch

        if next(BlockingFilter._calls) == self.config.call:
            time.sleep(self.config.seconds)
        return torch.ones(batch.batch_size, dtype=torch.bool)


@attrs.define
class BlockAtStepConfig:
    """``step``: the step whose ``log`` blocks."""

    step: int = 3
    seconds: float = DAY_S


class BlockingLogger(Logger):
    """See the module docstring."""

    def __init__(self, config: BlockAtStepConfig) -> None:
        self.config = config

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if step == self.config.step:
            time.sleep(self.config.seconds)


class BlockingWorkflow(RolloutWorkflow):
    """See the module docstring."""

    _calls = itertools.count(1)

    def __init__(self, config: BlockOnCallConfig) -> None:
        self.config = config

    async def run(self, prompt: Any, ctx: WorkflowContext) -> list[Any]:
        if next(BlockingWorkflow._calls) == self.config.call:
            time.sleep(self.config.seconds)  # blocks the controller's event loop: the mistake under test
        return await ctx.generate(prompt.prompt_ids, ctx.sampling)


def in_environment(config: Mapping[str, Any], tool_timeout_s: float, **environment: Any) -> dict[str, Any]:
    """``config`` (:func:`core_rl.testing.faults.build_task`'s) with the ``environment`` workflow
    driving the ``block`` environment (``environment``: its options), one turn per trajectory, steps
    bounded by ``tool_timeout_s``, trained on what the environment paid (reward ``workflow``)."""
    rollout = dict(config["rollout"])
    rollout["workflow"] = {
        "name": "environment",
        "max_turns": 1,
        "tool_timeout_s": tool_timeout_s,
        "environment": {"name": "block", **environment},
    }
    return {**config, "rollout": rollout, "reward": {"name": "workflow"}}
