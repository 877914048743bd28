"""Running an agent program for one episode: an in-process callable or a script in a subprocess.

In-process (``package.module:function``, or ``path/to/file.py:function`` loaded from the file):
``function(base_url=..., api_key=..., row=...)``; an
``async`` function runs on the rollout loop (it must not block it: use ``openai.AsyncOpenAI``), a
plain one in a thread of that loop (``openai.OpenAI`` is fine there; a thread cannot be stopped, so
past the timeout its later calls are refused with a 409). Its return value, when a number, is the
episode's reward.

Script (``path/to/agent.py``): ``python agent.py *args`` with ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``CORE_RL_ROW`` (the row as JSON) in its environment, in a new process
group that is killed when the episode times out or the run stops. ``python`` is the interpreter
(``rollout.workflow.python``, or the one of the environment built from
``rollout.workflow.requirements``: :mod:`core_rl_openai_proxy.agent_env`; default: core-rl's own).
The end of its stdout and stderr (:data:`OUTPUT_TAIL` characters) is kept as the episode's
``output``; a non-zero exit status is an :class:`AgentFailed` quoting it.

A function with ``python`` or ``requirements`` (another interpreter): it runs in one worker
process of that interpreter for the whole run (the server kit's library worker,
:mod:`core_rl_server_kit.worker`, with :mod:`core_rl_openai_proxy.agent_adapter`), which imports it
once; an episode is one request to it, cancelled there when the episode times out. A worker that
dies fails the episodes in flight (``kind``: ``exit status N``) and the next episode starts another.

Either way a failure is an :class:`AgentFailed` whose ``kind`` is the exception's class name
(``MaxTurnsExceeded``) or ``exit status N``; the workflow makes it an errored episode.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
from core_rl.errors import ConfigError, CoreRLError
from core_rl.plugins import LoadFailed, is_async, load_callable
from core_rl_server_kit.worker import AdapterError, Worker, WorkerFailed, WorkerSpec

#: the adapter a worker runs for a function in another interpreter
ADAPTER = Path(__file__).with_name("agent_adapter.py")
#: how much longer than an episode's limit a worker's request may take (the episode's own limit stops it first)
WORKER_GRACE_S = 60.0
#: how much of a script's stdout and stderr an episode keeps (and a failure quotes)
OUTPUT_TAIL = 2000
#: how long a killed script's process may take to exit and be reaped
REAP_TIMEOUT_S = 30.0


class AgentFailed(CoreRLError):
    """The agent program raised (``kind``: the exception's class name) or exited non-zero
    (``kind``: ``exit status N``, or the class of the exception a traceback on its stderr ends
    with); ``output``: a script's output tail; ``summary``: one line. Raised out of a run, exit
    status 1."""

    exit_code = 1

    def __init__(self, message: str, kind: str, output: str = "", summary: str = "") -> None:
        super().__init__(message)
        self.kind, self.output = kind, output
        #: one line: what failed (the exception and its message, or the exit status)
        self.summary = summary or message.splitlines()[0]


@attrs.define
class Outcome:
    """One finished episode of the program: what an in-process function ``returned`` (``None``
    for a script) and a script's ``output`` tail (stdout, then stderr)."""

    returned: Any = None
    output: str = ""


class AgentProgram:
    """``program`` (``rollout.workflow.program``) loaded once; :meth:`run` runs one episode."""

    def __init__(self, program: str, args: list[str], python: str | None = None, *, timeout_s: float = 300.0) -> None:
        """``timeout_s``: an episode's limit (``rollout.workflow.timeout_s``, which the workflow
        applies); a worker's request is given a little more, so that limit is what stops it."""
        self.program, self.args, self.python = program, list(args), python or sys.executable
        self.script: Path | None = None
        self.function: Callable[..., Any] | None = None
        self.worker_spec: WorkerSpec | None = None
        self._worker: Worker | None = None
        self._starting = threading.Lock()
        if program.endswith(".py"):  # a script: a subprocess per episode
            self.script = Path(program).resolve()
            if not self.script.is_file():
                raise ConfigError([f"rollout.workflow.program: no script at {program!r} (from {Path.cwd()})"])
            return
        if python is not None:  # a function in another interpreter: one worker for the run
            where = program.rpartition(":")[0]
            if where.endswith(".py") and not Path(where).is_file():
                raise ConfigError([f"rollout.workflow.program: no file at {where!r} (from {Path.cwd()})"])
            self.worker_spec = WorkerSpec(
                who=f"agent program {program}",
                key="rollout.workflow.program",
                python=python,
                adapter=str(ADAPTER),
                options=json.dumps({"program": program}),
                path=(str(Path.cwd()),),  # a package.module program is found from here, as in-process
                call_timeout_s=timeout_s + WORKER_GRACE_S,
            )
            return
        try:
            self.function = load_callable(program)
        except LoadFailed as exc:
            raise ConfigError([f"rollout.workflow.program: cannot load {program!r}: {exc}"]) from exc

    async def run(self, base_url: str, api_key: str, row: Mapping[str, Any]) -> Outcome:
        """One episode; raises :class:`AgentFailed` when the program fails."""
        if self.script is not None:
            return await self._run_script(base_url, api_key, row)
        kwargs = {"base_url": base_url, "api_key": api_key, "row": dict(row)}
        if self.worker_spec is not None:
            return Outcome(await self._in_worker(kwargs))
        assert self.function is not None
        try:
            if is_async(self.function):
                return Outcome(await self.function(**kwargs))
            return Outcome(await asyncio.to_thread(self.function, **kwargs))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            cause = f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
            kind = type(exc).__name__
            message = f"agent program {self.program} raised {kind}: {exc}{cause}"
            raise AgentFailed(message, kind, summary=f"{kind}: {' '.join(str(exc).split())}"[:300]) from exc

    def close(self) -> None:
        """Stop the worker of a function run in another interpreter (nothing to do otherwise)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()

    def _live_worker(self) -> Worker:
        """The worker, started first (once, whatever the episodes waiting for it) or again after it died."""
        assert self.worker_spec is not None
        with self._starting:
            if self._worker is None or self._worker.process.poll() is not None:
                self._worker = Worker(self.worker_spec)
            return self._worker

    async def _in_worker(self, kwargs: Mapping[str, Any]) -> Any:
        """One episode in the worker (started, or started again after it died, off the event loop)."""
        try:
            worker = await asyncio.to_thread(self._live_worker)
        except WorkerFailed as exc:
            raise AgentFailed(str(exc), "WorkerStart", summary=str(exc).splitlines()[0][:300]) from None
        try:
            return await worker.acall("episode", **kwargs)
        except AdapterError as exc:
            message = f"agent program {self.program} raised {exc}"
            raise AgentFailed(message, exc.kind, summary=" ".join(str(exc).split())[:300]) from None
        except WorkerFailed as exc:
            code = worker.process.poll()
            kind = f"exit status {code}" if code is not None else "WorkerFailed"
            raise AgentFailed(str(exc), kind, summary=str(exc).splitlines()[0][:300]) from None

    async def _run_script(self, base_url: str, api_key: str, row: Mapping[str, Any]) -> Outcome:
        assert self.script is not None
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        env["CORE_RL_ROW"] = json.dumps(dict(row))
        proc = await asyncio.create_subprocess_exec(
            self.python,
            str(self.script),
            *self.args,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            stdout, stderr = await proc.communicate()
        except BaseException as exc:  # timed out or cancelled: the whole process group goes, at once
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if await _reaped(proc):  # a second cancellation came while reaping: it goes on
                raise asyncio.CancelledError from exc
            raise
        output = _tail(stdout, stderr)
        if proc.returncode != 0:
            kind, last = _exception_kind(stderr.decode(errors="replace"))
            raise AgentFailed(
                f"agent script {self.script} exited with status {proc.returncode}; its output ends:\n{output}",
                kind or f"exit status {proc.returncode}",
                output,
                f"{self.script.name} exited with status {proc.returncode}" + (f" ({last})" if last else ""),
            )
        return Outcome(output=output)


_RAISED = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def _exception_kind(stderr: str) -> tuple[str | None, str]:
    """The class name of the exception a Python script died of and the line naming it: the last
    line of its stderr's last traceback that names one (``agents.exceptions.MaxTurnsExceeded:
    ...`` gives ``MaxTurnsExceeded``); ``(None, "")`` without a traceback."""
    _, found, after = stderr.rpartition("Traceback (most recent call last):")
    if not found:
        return None, ""
    for line in reversed(after.splitlines()):
        match = _RAISED.match(line)
        if match:
            return match.group(1).rsplit(".", 1)[-1], line.strip()[:300]
    return None, ""


def _tail(stdout: bytes, stderr: bytes) -> str:
    """The last :data:`OUTPUT_TAIL` characters of a script's stdout and stderr, each labelled."""
    parts = [
        f"[{name}]\n{data.decode(errors='replace')}" for name, data in (("stdout", stdout), ("stderr", stderr)) if data
    ]
    return "\n".join(parts)[-OUTPUT_TAIL:]


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
