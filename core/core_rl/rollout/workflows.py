"""Rollout workflows: how one data row becomes the trajectories of one group.

A workflow (``rollout.workflow``, a plugin kind registered through
:func:`core_rl.hookspecs.core_rl_register_workflows`) is an ``async`` function of a prompt and a
:class:`WorkflowContext`. It calls :meth:`WorkflowContext.generate` as often as it likes: the
single-turn RLVR workflow (:class:`SingleTurnWorkflow`, the default) calls it once for the
``sampling.n`` samples of the prompt; a multi-turn or agentic workflow calls it once per turn, feeds
the sample's tokens back with the next turn's prompt, and appends tool or environment output with
:func:`append_observation`, whose tokens are masked from the loss (``Sample.token_mask``).

What a workflow returns is one group: the samples the group's advantage is computed over (for
GRPO, the ``n`` answers to the row). Each returned sample is one trajectory: ``prompt_ids`` is the
row's prompt, ``response_ids`` everything after it (all turns), ``logprobs`` the behaviour
log-probs (0 on appended tokens), ``token_weight_versions`` the weight version of each token.
The rollout controller (:mod:`core_rl.rollout.controller`) runs many workflows concurrently; the
trainer scores the samples with the run's reward.

A trajectory that failed (its environment timed out, say) but is still returned carries
``info[FAILED]``, a short reason: it counts as a failed episode, and a step whose every episode
failed is a *failed step* (:mod:`core_rl.loops.rl.failed_steps`).

An episode ended by an error of the program a workflow runs (an agent that raised) carries
``info[ERROR]``, the error's kind (an exception's class name), and ``info[ERROR_LIMIT]``, the most
of a step's episodes that may end so; a workflow that leaves such episodes out of their group
records them on a kept sample as ``info[DROPPED_ERRORS]`` (``{kind: count}``). The trainer counts
the kinds per step (``agent/errors/<kind>``) and stops the run past the limit
(:class:`core_rl.loops.rl.failed_steps.AgentErrorsError`).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs

from core_rl.errors import PluginFault
from core_rl.interfaces import SamplingParams
from core_rl.protocol import Sample

#: the key of ``Sample.info`` that marks a failed episode (its value: why, e.g. ``step timed out``)
FAILED = "failed"
#: the key of ``Sample.info`` naming the kind of error that ended an episode (e.g. ``MaxTurnsExceeded``)
ERROR = "error"
#: the key of ``Sample.info`` holding the most of a step's episodes (a fraction) that may end in an error
ERROR_LIMIT = "max_error_fraction"
#: the key of ``Sample.info`` counting, by kind, the errored episodes its workflow left out of the group
DROPPED_ERRORS = "dropped_errors"


class _RowMedia:
    """The type of :data:`ROW_MEDIA`."""

    def __repr__(self) -> str:
        return "ROW_MEDIA"


#: the default ``media`` of :attr:`WorkflowContext.generate`: the prompt row's own pixel inputs
ROW_MEDIA: Any = _RowMedia()


@attrs.define
class WorkflowContext:
    """What a workflow may use: ``generate(prompt_ids, sampling, *, media=ROW_MEDIA)`` (the rollout
    engine, through the controller, which records versions and bounds concurrency), the run's
    ``sampling`` settings and its ``tokenizer`` (to encode tool output or the next turn's text).

    ``media``: the pixel inputs of the images whose placeholders ``prompt_ids`` hold (a
    vision-language model's, :attr:`core_rl.protocol.Sample.media`). Left out, the prompt row's
    own (its images, already in its ``prompt_ids``); a workflow that builds its own prompts (an
    agent's messages) passes what they hold, ``None`` for none. The samples carry it."""

    generate: Callable[..., Awaitable[list[Sample]]]
    sampling: SamplingParams
    tokenizer: Any = None


class RolloutWorkflow(ABC):
    """Turns one prompt (a :class:`core_rl.data.prompts.PromptItem`: its ``row``, ``text`` and
    ``prompt_ids``) into one group of trajectories.

    ``own_prompts``: the trajectories start from prompts the workflow builds itself (an agent
    program writes its own messages from the row), so their ``prompt_ids`` need not be the row's."""

    own_prompts: bool = False

    @abstractmethod
    async def run(self, prompt: Any, ctx: WorkflowContext) -> list[Sample]:
        """The trajectories of ``prompt`` (at least one), each a :class:`Sample` whose
        ``prompt_ids`` are ``prompt.prompt_ids``. Must not keep state between calls that would
        change what a resumed run generates."""


T = TypeVar("T")


async def gather_group(trajectories: Sequence[Awaitable[T]]) -> list[T]:
    """Run a group's ``trajectories`` (coroutines or tasks) concurrently: their results, in order.
    The first that raises cancels the others, waits for them to end and re-raises its own exception,
    so a failed group leaves nothing running on the loop (``asyncio.gather`` leaves the rest
    running); cancelling the caller cancels them all."""
    tasks = [asyncio.ensure_future(t) for t in trajectories]
    if not tasks:
        return []
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t in done and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task in tasks:  # marks every other exception retrieved: the group reports its first
            if task.done() and not task.cancelled():
                task.exception()


class SingleTurnWorkflow(RolloutWorkflow):
    """RLVR: one generation call for the ``n`` samples of the prompt."""

    async def run(self, prompt: Any, ctx: WorkflowContext) -> list[Sample]:
        return await ctx.generate(prompt.prompt_ids, ctx.sampling)


def check_samples(
    value: Any, words: str, what: str, *, prompt_ids: Sequence[int] | None, count: int | None, contract: str
) -> list[Sample]:
    """``value`` as a list of :class:`Sample` s answering ``prompt_ids`` (any prompt when ``None``):
    exactly ``count`` of them (at least one when ``None``). Otherwise a :class:`~core_rl.errors.PluginFault` naming the
    component (``words``), ``what`` it returned and the ``contract`` it breaks."""
    if isinstance(value, Sample) or not isinstance(value, Sequence):
        raise PluginFault(f"{words} returned {what} as a {type(value).__name__}; {contract}")
    samples = list(value)
    wanted = f"{count}" if count is not None else "at least 1"
    if (count is not None and len(samples) != count) or not samples:
        raise PluginFault(f"{words} returned {len(samples)} {what} where {wanted} were due; {contract}")
    for i, sample in enumerate(samples):
        if not isinstance(sample, Sample):
            raise PluginFault(f"{words} returned {what} whose item {i} is a {type(sample).__name__}; {contract}")
        if prompt_ids is not None and list(sample.prompt_ids) != list(prompt_ids):
            raise PluginFault(
                f"{words} returned {what} whose item {i} has prompt_ids {list(sample.prompt_ids)[:8]}... "
                f"({len(sample.prompt_ids)} tokens), not the prompt's ({len(prompt_ids)} tokens); {contract}"
            )
    return samples


def append_observation(sample: Sample, token_ids: Sequence[int]) -> Sample:
    """``sample`` with ``token_ids`` (tool or environment output) appended to its response:
    log-prob 0, mask 0 (they never train), the version of the sample's last token, and no route
    (-1: the training forward routes them itself, :attr:`~core_rl.protocol.Sample.routed_experts`)."""
    n = len(sample.response_ids)
    versions = sample.versions
    last = versions[-1] if versions else sample.weight_version
    mask = list(sample.token_mask) if sample.token_mask is not None else [1] * n
    return attrs.evolve(
        sample,
        response_ids=[*sample.response_ids, *token_ids],
        logprobs=[*sample.logprobs, *([0.0] * len(token_ids))],
        token_weight_versions=[*versions, *([last] * len(token_ids))],
        token_mask=[*mask, *([0] * len(token_ids))],
        routed_experts=_routes_extended(sample.routed_experts, len(token_ids)),
    )


def _routes_extended(routes: Any, count: int) -> Any:
    """``routes`` ``[n, L, K]`` followed by ``count`` rows without a route (``None`` stays ``None``)."""
    if routes is None:
        return None
    import torch

    return torch.cat([routes, routes.new_full((count, *routes.shape[1:]), -1)])


def extend_turn(sample: Sample, turn: Sample) -> Sample:
    """``sample`` continued by ``turn``, a sample generated from ``sample.prompt_ids +
    sample.response_ids``: its tokens, log-probs and versions are appended (mask 1) and its
    ``finish_reason`` becomes the sample's. Routes (a mixture-of-experts rollout): the turn's, which
    cover the whole context (its prefill ran over every earlier token, and the turn's tokens were
    computed with those routes); a turn without routes adds rows of -1."""
    mask = list(sample.token_mask) if sample.token_mask is not None else [1] * len(sample.response_ids)
    return attrs.evolve(
        sample,
        response_ids=[*sample.response_ids, *turn.response_ids],
        logprobs=[*sample.logprobs, *turn.logprobs],
        token_weight_versions=[*sample.versions, *turn.versions],
        token_mask=[*mask, *([1] * len(turn.response_ids))],
        finish_reason=turn.finish_reason,
        weight_version=min(sample.weight_version, turn.weight_version),
        routed_experts=turn.routed_experts
        if turn.routed_experts is not None
        else _routes_extended(sample.routed_experts, len(turn.response_ids)),
    )
