"""Running an agent program for one episode: an in-process callable or a script in a subprocess.

In-process (``package.module:function``, or ``path/to/file.py:function`` loaded from the file):
``function(base_url=..., api_key=..., row=...)``; an
``async`` function runs on the rollout loop (it must not block it: use ``openai.AsyncOpenAI``), a
plain one in a thread of that loop (``openai.OpenAI`` is fine there; a thread cannot be stopped, so
past the timeout its later calls are refused with a 409). Its return value, when a number, is the
episode's reward.

Script (``path/to/agent.py``): ``python agent.py *args`` with ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``CORE_RL_ROW`` (the row as JSON) in its environment, in a new process
group that is killed when the episode times out or the run stops; a non-zero exit status is an
error naming the script and the end of its stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from core_rl.callables import LoadFailed, is_async, load_callable
from core_rl.errors import ConfigError, CoreRLError

#: how much of a failed script's stderr an error quotes
STDERR_TAIL = 2000
#: how long a killed script's process may take to exit and be reaped
REAP_TIMEOUT_S = 30.0


class AgentFailed(CoreRLError):
    """The agent program raised or exited non-zero: the run fails (exit status 1)."""

    exit_code = 1


class AgentProgram:
    """``program`` (``rollout.workflow.program``) loaded once; :meth:`run` runs one episode."""

    def __init__(self, program: str, args: list[str]) -> None:
        self.program, self.args = program, list(args)
        self.script: Path | None = None
        self.function: Callable[..., Any] | None = None
        if program.endswith(".py"):  # a script: a subprocess per episode
            self.script = Path(program).resolve()
            if not self.script.is_file():
                raise ConfigError([f"rollout.workflow.program: no script at {program!r} (from {Path.cwd()})"])
            return
        try:
            self.function = load_callable(program)
        except LoadFailed as exc:
            raise ConfigError([f"rollout.workflow.program: cannot load {program!r}: {exc}"]) from exc

    async def run(self, base_url: str, api_key: str, row: Mapping[str, Any]) -> Any:
        """One episode; returns what an in-process function returned (``None`` for a script)."""
        if self.script is not None:
            return await self._run_script(base_url, api_key, row)
        assert self.function is not None
        kwargs = {"base_url": base_url, "api_key": api_key, "row": dict(row)}
        try:
            if is_async(self.function):
                return await self.function(**kwargs)
            return await asyncio.to_thread(self.function, **kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            cause = f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
            raise AgentFailed(f"agent program {self.program} raised {type(exc).__name__}: {exc}{cause}") from exc

    async def _run_script(self, base_url: str, api_key: str, row: Mapping[str, Any]) -> None:
        assert self.script is not None
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        env["CORE_RL_ROW"] = json.dumps(dict(row))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(self.script),
            *self.args,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, stderr = await proc.communicate()
        except BaseException as exc:  # timed out or cancelled: the whole process group goes, at once
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if await _reaped(proc):  # a second cancellation came while reaping: it goes on
                raise asyncio.CancelledError from exc
            raise
        if proc.returncode != 0:
            tail = stderr.decode(errors="replace")[-STDERR_TAIL:]
            raise AgentFailed(f"agent script {self.script} exited with status {proc.returncode}; stderr ends:\n{tail}")
        return None


async def _reaped(proc: asyncio.subprocess.Process) -> bool:
    """Wait until the killed ``proc`` has exited and been reaped, at most :data:`REAP_TIMEOUT_S`,
    through any cancellation that arrives meanwhile (an episode's timeout and the run's stop of its
    siblings can both cancel it); whether one arrived."""
    waiter = asyncio.ensure_future(proc.wait())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REAP_TIMEOUT_S
    cancelled = False
    while not waiter.done() and loop.time() < deadline:
        try:
            await asyncio.wait({waiter}, timeout=deadline - loop.time())  # never cancels the waiter
        except asyncio.CancelledError:
            cancelled = True
    if not waiter.done():
        waiter.cancel()
        raise CoreRLError(f"agent script (pid {proc.pid}) did not exit within {REAP_TIMEOUT_S:g} s of SIGKILL")
    return cancelled
