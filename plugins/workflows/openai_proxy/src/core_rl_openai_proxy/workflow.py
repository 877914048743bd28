"""The ``openai_agent`` rollout workflow: an agent program, once per sample, against the proxy.

For each data row the workflow opens ``rollout.sampling.n`` sessions on the run's proxy (started on
the first row, on a free local port, and kept for the run) and runs the program once per session,
concurrently, each with its session id as the API key. When the episodes end, each session's
trajectories (usually one; more after a history mismatch) form the row's group. A trajectory's
reward is, in order: ``timeout_reward`` if the episode timed out, the number an in-process function
returned, the reward the agent posted to the proxy, else ``None`` (select ``reward: {name:
workflow}``, with a ``default`` if some episodes may set none).

An episode the agent ends in an error (:class:`~core_rl_openai_proxy.program.AgentFailed`: an
exception, a script's non-zero exit) keeps the calls it made: its trajectories are scored
``error_reward`` (or left out of the group, ``on_error: drop``) and carry ``info["error"]`` (the
error's kind, counted per step as ``agent/errors/<kind>``), ``info["failed"]`` (the message) and
``info["max_error_fraction"]``: past that fraction of a step's episodes the trainer stops the run
(:mod:`core_rl.loops.rl.failed_steps`). An errored episode that made no call has nothing to train
on and is left out; a row whose every episode errored before any call fails the run with the
error. A script's output tail is kept in ``info["output"]`` (``rollout.dump`` records it).

The proxy's calls reach the engine through the workflow's context (:class:`WorkflowContext`), on
the rollout loop, so the controller's admission, concurrency bound, wave batching and weight
versions apply to them exactly as to the built-in workflows, in synchronous and asynchronous runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import attrs
from core_rl.errors import CoreRLError
from core_rl.interfaces import SamplingParams
from core_rl.protocol import Sample
from core_rl.rollout import (
    DROPPED_ERRORS,
    ERROR,
    ERROR_LIMIT,
    FAILED,
    RolloutWorkflow,
    WorkflowContext,
    gather_group,
)

from core_rl_openai_proxy.agent_env import agent_python
from core_rl_openai_proxy.config import OpenAIAgentConfig
from core_rl_openai_proxy.program import AgentFailed, AgentProgram, Outcome
from core_rl_openai_proxy.server import ProxyServer
from core_rl_openai_proxy.session import Session


class AgentMadeNoCall(CoreRLError):
    """An episode ended without a model call: there is nothing to train on (exit status 1)."""

    exit_code = 1


class OpenAIAgentWorkflow(RolloutWorkflow):
    """See the module docstring."""

    own_prompts = True

    def __init__(self, config: OpenAIAgentConfig) -> None:
        self.config = config
        # a script, or a function given an interpreter of its own (else it runs in-process)
        own = config.program.endswith(".py") or config.python or config.requirements
        python = agent_python(config.python, config.requirements) if own else None
        self.program = AgentProgram(config.program, config.args, python, timeout_s=config.timeout_s)
        self.proxy: ProxyServer | None = None
        self._starting = threading.Lock()

    def server(self, tokenizer: Any) -> ProxyServer:
        """The run's proxy, started on first use."""
        with self._starting:
            if self.proxy is None:
                if tokenizer is None:
                    raise CoreRLError("rollout.workflow openai_agent needs the run's tokenizer; the context has none")
                proxy = ProxyServer(tokenizer, self.config)
                proxy.start()
                self.proxy = proxy
            return self.proxy

    def close(self) -> None:
        self.program.close()
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None

    async def run(self, prompt: Any, ctx: WorkflowContext) -> list[Sample]:
        proxy = self.server(ctx.tokenizer)
        loop = asyncio.get_running_loop()

        def generate(prompt_ids: Sequence[int], sampling: SamplingParams, media: Any = None) -> asyncio.Future:
            # called on the proxy's loop; the generation runs on the rollout loop. The images are
            # those the agent's messages hold (none: the row's images reach the model only if the
            # agent sends them)
            call = ctx.generate(prompt_ids, sampling, media=media)
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, loop))

        sessions = [proxy.open(generate, ctx.sampling, prompt.row) for _ in range(ctx.sampling.n)]
        # a failed (or cancelled) episode stops its siblings, scripts killed, before the error goes on
        return self._group(await gather_group([self._episode(proxy, session) for session in sessions]))

    def _group(self, episodes: list[tuple[list[Sample], AgentFailed | None]]) -> list[Sample]:
        """The row's group: every episode's samples; under ``on_error: drop`` the errored ones are
        left out, counted on a kept sample (``info["dropped_errors"]``), unless none is left."""
        kept = [
            samples for samples, error in episodes if samples and (error is None or self.config.on_error == "score")
        ]
        dropped: dict[str, int] = {}
        for samples, error in episodes:
            if error is not None and (self.config.on_error == "drop" or not samples):
                dropped[error.kind] = dropped.get(error.kind, 0) + 1
        if not kept:  # every episode errored: score them (a group needs samples), or fail when none called
            kept = [samples for samples, _ in episodes if samples]
            if not kept:
                raise next(error for _, error in episodes if error is not None)
            dropped = {}
        out = [sample for samples in kept for sample in samples]
        if dropped:
            first = out[0]
            out[0] = attrs.evolve(
                first, info={**first.info, DROPPED_ERRORS: dropped, ERROR_LIMIT: self.config.max_error_fraction}
            )
        return out

    async def _episode(self, proxy: ProxyServer, session: Session) -> tuple[list[Sample], AgentFailed | None]:
        timed_out, outcome, error = False, Outcome(), None
        try:
            # asyncio.timeout, not wait_for: the program runs in this task, so a cancellation arriving
            # while the timeout fires still reaches the script's clean-up (wait_for could leave its
            # inner task, and the script, behind)
            async with asyncio.timeout(self.config.timeout_s):
                outcome = await self.program.run(proxy.base_url, session.id, session.row)
        except TimeoutError:
            timed_out = True
        except AgentFailed as exc:
            error = exc
        finally:
            proxy.end(session)
        if session.error is not None:
            raise session.error
        if error is not None:
            info = {
                ERROR: error.kind,
                FAILED: f"agent error: {error.summary}",
                ERROR_LIMIT: self.config.max_error_fraction,
            }
            if error.output:
                info["output"] = error.output
            return session.samples(self.config.error_reward, **info), error
        if not session.trajectories:
            why = f"timed out after {self.config.timeout_s:g} s (rollout.workflow.timeout_s)" if timed_out else "ended"
            raise AgentMadeNoCall(
                f"agent program {self.config.program} {why} without a model call through the proxy for row "
                f"{str(session.row)[:120]}; it must call the base_url it is given"
            )
        returned = outcome.returned
        if timed_out:
            reward = self.config.timeout_reward
        elif isinstance(returned, int | float) and not isinstance(returned, bool):
            reward = float(returned)
        else:
            reward = session.reward
        extra = {"output": outcome.output} if outcome.output else {}
        return session.samples(reward, timed_out=timed_out, **extra), None
