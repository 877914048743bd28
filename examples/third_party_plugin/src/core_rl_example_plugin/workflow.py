"""The ``second_try`` rollout workflow: a two-turn environment that assigns its own reward.

Each of the ``n`` samples of a prompt answers once and the environment scores the answer against
the row's answer (:func:`position_score`). A perfect first answer ends the trajectory with reward 1.
Otherwise the environment replies ``feedback`` (appended with
:func:`core_rl.rollout.workflows.append_observation`, so those tokens are masked from the loss) and the
policy answers again, continuing the whole conversation; the trajectory's reward is then
``second_try_credit`` times the second answer's score. The reward goes in ``Sample.reward`` (select
``reward: {name: workflow}``, alone or as a part of ``combine``); the turns and their scores go in
``Sample.info``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import attrs
from core_rl.protocol import Sample
from core_rl.rollout import RolloutWorkflow, WorkflowContext, append_observation, extend_turn

from core_rl_example_plugin.config import SecondTryConfig


def position_score(text: str, answer: str) -> float:
    """The fraction of the answer's positions the text matches: ``|{i : text[i] == answer[i]}| /
    len(answer)`` over ``i < len(answer)`` (1.0 for an empty answer)."""
    if not answer:
        return 1.0
    return sum(a == b for a, b in zip(text, answer)) / len(answer)


class SecondTryWorkflow(RolloutWorkflow):
    """See the module docstring."""

    def __init__(self, config: SecondTryConfig) -> None:
        self.config = config

    def feedback_ids(self, tokenizer: Any) -> list[int]:
        """The token ids of ``feedback``; a character the tokenizer cannot encode is an error."""
        ids = list(tokenizer.encode(self.config.feedback, add_special_tokens=False))
        if tokenizer.decode(ids) != self.config.feedback:
            raise ValueError(
                f"rollout.workflow.feedback {self.config.feedback!r} does not survive the tokenizer "
                f"(decodes as {tokenizer.decode(ids)!r}); use characters of its vocabulary"
            )
        return ids

    async def run(self, prompt: Any, ctx: WorkflowContext) -> list[Sample]:
        answer = str(prompt.row[self.config.answer_key])
        feedback = self.feedback_ids(ctx.tokenizer)
        first = await ctx.generate(prompt.prompt_ids, ctx.sampling)
        return list(await asyncio.gather(*(self._finish(s, answer, feedback, ctx) for s in first)))

    async def _finish(self, sample: Sample, answer: str, feedback: Sequence[int], ctx: WorkflowContext) -> Sample:
        text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        score = position_score(text, answer)
        if score == 1.0:
            return attrs.evolve(sample, reward=1.0, info={"turns": 1, "scores": [score], "answers": [text]})
        asked = append_observation(sample, feedback)
        (turn,) = await ctx.generate([*asked.prompt_ids, *asked.response_ids], attrs.evolve(ctx.sampling, n=1))
        second_text = ctx.tokenizer.decode(turn.response_ids, skip_special_tokens=True)
        second = position_score(second_text, answer)
        return attrs.evolve(
            extend_turn(asked, turn),
            reward=self.config.second_try_credit * second,
            info={"turns": 2, "scores": [score, second], "answers": [text, second_text]},
        )
