"""An agent function in another interpreter (``rollout.workflow.python`` with a
``file.py:function`` program) runs in one worker process for the run
(:mod:`core_rl_openai_proxy.agent_worker`): imported once, every episode a message; its return value
is the reward, its exception an errored episode of that class, its death the episodes' failure and
a new worker for the next. The interpreter here is core-rl's own, given by path (the openai-agents
SDK's own environment: test_proxy_openai_agents.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

WORKER_AGENTS = Path(__file__).resolve().parent / "worker_agents.py"
ROWS = [{"prompt": "1+2"}, {"prompt": "4+4"}]


def _options(function: str, **more) -> dict:
    return {"program": f"{WORKER_AGENTS}:{function}", "python": sys.executable, **more}


def test_one_worker_serves_every_episode_and_its_return_is_the_reward(run_wave) -> None:
    first, workflow = run_wave(ROWS, n=3, **_options("worker_pid"))
    second, _ = run_wave(ROWS[:1], n=2, **_options("worker_pid"))
    rewards = {s.reward for group in first.groups for s in group}
    (reward,) = rewards  # one worker for the six episodes of the run
    pid, imports = divmod(int(reward), 10)
    assert pid not in (os.getpid(), 0) and imports == 1  # another process, which imported the function once
    assert all(s.info["calls"] == 1 and s.response_ids for g in first.groups for s in g)
    assert {s.reward for s in second.groups[0]} != rewards  # another run: another worker (the first was closed)
    assert workflow.program.worker is not None


def test_a_plain_function_runs_in_a_thread_of_the_worker(run_wave) -> None:
    wave, _ = run_wave(ROWS[:1], n=2, **_options("sync_call"))
    assert [s.reward for s in wave.groups[0]] == [2.0, 2.0]


def test_an_exception_in_the_worker_is_an_errored_episode_of_its_class(run_wave) -> None:
    wave, _ = run_wave(ROWS[:1], n=2, **_options("raises", error_reward=-1.0, max_error_fraction=1.0))
    for sample in wave.groups[0]:
        assert sample.reward == -1.0 and sample.info["error"] == "ValueError"
        assert "no answer in the reply" in sample.info["failed"]


def test_a_dead_worker_fails_its_episodes(run_wave) -> None:
    wave, _ = run_wave(ROWS, n=1, **_options("dies", error_reward=-1.0, max_error_fraction=1.0))
    samples = [s for group in wave.groups for s in group]
    assert samples and all(s.info["error"] == "exit status 3" and s.reward == -1.0 for s in samples)
    assert all("exited with status 3" in s.info["failed"] for s in samples)


def test_after_a_worker_dies_the_next_episode_starts_another() -> None:
    import asyncio

    import pytest
    from core_rl_openai_proxy.agent_worker import AgentWorker
    from core_rl_openai_proxy.program import AgentFailed

    async def episodes() -> tuple[int, int]:
        alive = AgentWorker(f"{WORKER_AGENTS}:pid", sys.executable)
        dying = AgentWorker(f"{WORKER_AGENTS}:exit_now", sys.executable)
        try:
            first = await alive.run({})
            assert await alive.run({}) == first  # the same worker
            with pytest.raises(AgentFailed, match="exited with status 3") as failed:
                await dying.run({})
            assert failed.value.kind == "exit status 3"
            with pytest.raises(AgentFailed, match="exited with status 3"):
                await dying.run({})  # a new worker, which dies again
            alive.close()
            return first, await alive.run({})
        finally:
            alive.close()
            dying.close()

    first, after_close = asyncio.run(episodes())
    assert first != after_close


def test_a_function_that_cannot_be_imported_is_named() -> None:
    import asyncio

    import pytest
    from core_rl_openai_proxy.agent_worker import AgentWorker
    from core_rl_openai_proxy.program import AgentFailed

    worker = AgentWorker(f"{WORKER_AGENTS}:no_such_function", sys.executable)
    with pytest.raises(AgentFailed, match=r"could not import .*worker_agents.py:no_such_function: AttributeError"):
        asyncio.run(worker.run({}))
    worker.close()
