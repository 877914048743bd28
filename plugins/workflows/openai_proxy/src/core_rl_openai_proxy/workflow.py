"""The ``openai_agent`` rollout workflow: an agent program, once per sample, against the proxy.

For each data row the workflow opens ``rollout.sampling.n`` sessions on the run's proxy (started on
the first row, on a free local port, and kept for the run) and runs the program once per session,
concurrently, each with its session id as the API key. When the episodes end, each session's
trajectories (usually one; more after a history mismatch) form the row's group. A trajectory's
reward is, in order: ``timeout_reward`` if the episode timed out, the number an in-process function
returned, the reward the agent posted to the proxy, else ``None`` (select ``reward: {name:
workflow}``, with a ``default`` if some episodes may set none).

The proxy's calls reach the engine through the workflow's context (:class:`WorkflowContext`), on
the rollout loop, so the controller's admission, concurrency bound, wave batching and weight
versions apply to them exactly as to the built-in workflows, in synchronous and asynchronous runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from core_rl.errors import CoreRLError
from core_rl.interfaces import SamplingParams
from core_rl.protocol import Sample
from core_rl.workflows import RolloutWorkflow, WorkflowContext

from core_rl_openai_proxy.config import OpenAIAgentConfig
from core_rl_openai_proxy.program import AgentProgram
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
        self.program = AgentProgram(config.program, config.args)
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
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None

    async def run(self, prompt: Any, ctx: WorkflowContext) -> list[Sample]:
        proxy = self.server(ctx.tokenizer)
        loop = asyncio.get_running_loop()

        def generate(prompt_ids: Sequence[int], sampling: SamplingParams) -> asyncio.Future:
            # called on the proxy's loop; the generation runs on the rollout loop
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(ctx.generate(prompt_ids, sampling), loop))

        sessions = [proxy.open(generate, ctx.sampling, prompt.row) for _ in range(ctx.sampling.n)]
        tasks = [asyncio.ensure_future(self._episode(proxy, session)) for session in sessions]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # a failed (or cancelled) episode stops its siblings, scripts killed, before the error goes on
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:  # the failure itself, not the siblings cancelled after it
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [sample for task in tasks for sample in task.result()]

    async def _episode(self, proxy: ProxyServer, session: Session) -> list[Sample]:
        timed_out, returned = False, None
        try:
            # asyncio.timeout, not wait_for: the program runs in this task, so a cancellation arriving
            # while the timeout fires still reaches the script's clean-up (wait_for could leave its
            # inner task, and the script, behind)
            async with asyncio.timeout(self.config.timeout_s):
                returned = await self.program.run(proxy.base_url, session.id, session.row)
        except TimeoutError:
            timed_out = True
        finally:
            proxy.end(session)
        if session.error is not None:
            raise session.error
        if not session.trajectories:
            why = f"timed out after {self.config.timeout_s:g} s (rollout.workflow.timeout_s)" if timed_out else "ended"
            raise AgentMadeNoCall(
                f"agent program {self.config.program} {why} without a model call through the proxy for row "
                f"{str(session.row)[:120]}; it must call the base_url it is given"
            )
        if timed_out:
            reward = self.config.timeout_reward
        elif isinstance(returned, int | float) and not isinstance(returned, bool):
            reward = float(returned)
        else:
            reward = session.reward
        return session.samples(reward, timed_out=timed_out)
