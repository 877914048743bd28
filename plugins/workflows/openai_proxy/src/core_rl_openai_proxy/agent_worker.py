"""An agent function run in another interpreter: one long-lived worker process per run.

``rollout.workflow.program: path/to/agent.py:function`` (or ``package.module:function``) with
``python`` or ``requirements`` runs ``function(base_url=..., api_key=..., row=...)`` in a worker
started with that interpreter (:class:`AgentWorker`), which imports the agent's libraries once
and then serves every episode of the run, so an episode costs a message, not a process start and
the framework's imports (script mode's cost). As in-process: an ``async`` function runs on the
worker's event loop, many episodes at once; a plain one in a thread of it; a number it returns is
the episode's reward; an exception it raises is an :class:`~core_rl_openai_proxy.program.AgentFailed`
of that class.

The protocol, one JSON object per line: the parent writes ``{"id", "kwargs"}`` (an episode) or
``{"cancel": id}`` to the worker's stdin; the worker answers ``{"ready": true}`` once the function
is imported (or ``{"fatal": message}`` and exits), then ``{"id", "returned"}`` or ``{"id",
"error": {"kind", "message", "traceback"}}`` per episode, on its real stdout. The function's own
prints go to stderr (its tail is kept for the error messages). A cancelled episode (its timeout,
the run stopping) is cancelled in the worker too; a plain function's thread cannot be stopped, and
the proxy refuses its later calls. A worker that exits fails the episodes in flight, naming its
exit status and stderr; the next episode starts a new one.

This file is also the worker: ``python agent_worker.py TARGET`` (standard library only, so it runs
under any interpreter; the parent side imports core-rl lazily).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: how long the worker may take to import the agent's function before its first episode
START_TIMEOUT_S = 300.0
#: how much of the worker's stderr a failure quotes
STDERR_TAIL = 2000
#: how long :meth:`AgentWorker.close` waits for the worker and its loop to stop
CLOSE_TIMEOUT_S = 10.0
#: the largest protocol line (a row or a returned value), bytes
LINE_LIMIT = 64 * 2**20


class AgentWorker:
    """The parent's side: the worker process of ``target`` under ``python``, started on the
    first :meth:`run`, restarted after it exits. Its pipes live on an event loop of its own, in a
    daemon thread, so :meth:`run` may be awaited from any loop and :meth:`close` called from any
    thread."""

    def __init__(self, target: str, python: str) -> None:
        self.target, self.python = target, python
        self._proc: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._stderr = ""
        self._starting: asyncio.Lock | None = None
        self._readers: list[asyncio.Task] = []
        self._started_procs: list[asyncio.subprocess.Process] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    async def run(self, kwargs: Mapping[str, Any]) -> Any:
        """One episode: what the function returned; raises
        :class:`~core_rl_openai_proxy.program.AgentFailed` when it raised or the worker died.
        Cancelling it cancels the episode in the worker."""
        with self._guard:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="agent-worker", daemon=True)
                self._thread.start()
            loop = self._loop
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._episode(kwargs), loop))

    def close(self) -> None:
        """Stop the worker (SIGKILL to its process group: its episodes are over) and its loop."""
        with self._guard:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(CLOSE_TIMEOUT_S)
        except Exception:  # the loop is blocked or gone: the process goes regardless
            if self._proc is not None:
                _kill_group(self._proc.pid)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()

    async def _episode(self, kwargs: Mapping[str, Any]) -> Any:
        proc = await self._started()
        self._next_id += 1
        episode, future = self._next_id, asyncio.get_running_loop().create_future()
        self._pending[episode] = future
        try:
            await self._send(proc, {"id": episode, "kwargs": dict(kwargs)})
            return await future
        except asyncio.CancelledError:
            if proc.returncode is None:
                try:
                    await self._send(proc, {"cancel": episode})
                except (ConnectionError, RuntimeError):
                    pass
            raise
        finally:
            self._pending.pop(episode, None)

    async def _shutdown(self) -> None:
        """Every worker this object started gone and reaped, and their pipes' readers ended."""
        self._proc = None
        for proc in self._started_procs:
            if proc.returncode is None:
                _kill_group(proc.pid)
            await proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        await asyncio.wait_for(asyncio.gather(*self._readers, return_exceptions=True), CLOSE_TIMEOUT_S)
        self._readers, self._started_procs = [], []

    # -- the parent's machinery -------------------------------------------------------------------

    async def _started(self) -> asyncio.subprocess.Process:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._proc is not None and self._proc.returncode is None:
                return self._proc
            self._stderr = ""
            proc = await asyncio.create_subprocess_exec(
                self.python,
                __file__,
                self.target,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=_worker_environment(),
                limit=LINE_LIMIT,
                start_new_session=True,
            )
            self._started_procs.append(proc)
            ready = asyncio.get_running_loop().create_future()
            self._readers += [
                asyncio.ensure_future(self._read_stdout(proc, ready)),
                asyncio.ensure_future(self._read_stderr(proc)),
            ]
            try:
                await asyncio.wait_for(asyncio.shield(ready), START_TIMEOUT_S)
            except TimeoutError:
                _kill_group(proc.pid)
                raise self._failed(
                    f"did not import {self.target} within {START_TIMEOUT_S:g} s", "WorkerStart"
                ) from None
            self._proc = proc
            return proc

    async def _send(self, proc: asyncio.subprocess.Process, message: Mapping[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(message).encode() + b"\n")
        await proc.stdin.drain()

    async def _read_stdout(self, proc: asyncio.subprocess.Process, ready: asyncio.Future) -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            message = json.loads(line)
            if "ready" in message:
                ready.set_result(True)
            elif "fatal" in message:
                if not ready.done():
                    ready.set_exception(self._failed(message["fatal"], "WorkerStart"))
            elif (future := self._pending.get(message["id"])) is not None and not future.done():
                if "error" in message:
                    future.set_exception(self._raised(message["error"]))
                else:
                    future.set_result(message.get("returned"))
        status = await proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()  # the last pipe open: closing it lets the transport finish
        await asyncio.sleep(0)  # the stderr reader's last lines
        died = self._failed(f"exited with status {status}", f"exit status {status}")
        if not ready.done():
            ready.set_exception(died)
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(died)

    async def _read_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for line in proc.stderr:
            self._stderr = (self._stderr + line.decode(errors="replace"))[-STDERR_TAIL:]

    def _failed(self, what: str, kind: str) -> Exception:
        from core_rl_openai_proxy.program import AgentFailed

        tail = f"; its stderr ends:\n{self._stderr}" if self._stderr.strip() else ""
        return AgentFailed(
            f"the agent worker of {self.target} ({self.python}) {what}{tail}",
            kind,
            summary=f"agent worker of {self.target} {what}",
        )

    def _raised(self, error: Mapping[str, Any]) -> Exception:
        from core_rl_openai_proxy.program import AgentFailed

        kind, message = str(error.get("kind", "Exception")), str(error.get("message", ""))
        return AgentFailed(
            f"agent program {self.target} raised {kind}: {message}\n{error.get('traceback', '')}".rstrip(),
            kind,
            summary=f"{kind}: {' '.join(message.split())}"[:300],
        )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _worker_environment() -> dict[str, str]:
    """The worker's environment: the parent's, with the working directory on ``PYTHONPATH`` (a
    ``package.module:function`` program is found from there, as in-process)."""
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path}


# -- the worker's side (standard library only) -----------------------------------------------------


def _load(target: str) -> Any:
    """``module:function`` or ``path/to/file.py:function``."""
    import importlib
    import importlib.util

    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).resolve()
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


async def _serve(function: Any, out: Any) -> None:
    loop = asyncio.get_running_loop()
    tasks: dict[int, asyncio.Future] = {}

    def answer(message: Mapping[str, Any]) -> None:
        out.write(json.dumps(message, default=repr) + "\n")
        out.flush()

    async def episode(episode_id: int, kwargs: dict[str, Any]) -> None:
        try:
            if inspect.iscoroutinefunction(function):
                returned = await function(**kwargs)
            else:
                returned = await loop.run_in_executor(None, lambda: function(**kwargs))
            answer({"id": episode_id, "returned": returned if isinstance(returned, int | float | str) else None})
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # the agent's own error: an episode's outcome, not the worker's
            answer(
                {
                    "id": episode_id,
                    "error": {
                        "kind": type(exc).__name__,
                        "message": str(exc),
                        "traceback": "".join(traceback.format_exception(exc))[-STDERR_TAIL:],
                    },
                }
            )
        finally:
            tasks.pop(episode_id, None)

    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    answer({"ready": True})
    async for line in reader:
        message = json.loads(line)
        if "cancel" in message:
            if (task := tasks.get(message["cancel"])) is not None:
                task.cancel()
        else:
            tasks[message["id"]] = asyncio.ensure_future(episode(message["id"], message["kwargs"]))
    for task in list(tasks.values()):  # stdin closed: the parent is gone
        task.cancel()


def main(target: str) -> None:
    out = os.fdopen(os.dup(1), "w")  # the protocol's stdout; the agent's prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        function = _load(target)
    except BaseException as exc:
        out.write(json.dumps({"fatal": f"could not import {target}: {type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        traceback.print_exc()
        raise SystemExit(1) from None
    asyncio.run(_serve(function, out))


if __name__ == "__main__":
    main(sys.argv[1])
