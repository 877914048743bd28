"""Library workers: environments and data sources whose work happens in a process started with
another interpreter, for libraries that cannot be installed beside core-rl (their pins would
change core-rl's own packages).

A plugin describes its worker with a :class:`WorkerSpec`: the interpreter (``python``, or a venv
built from ``requirements`` by :func:`library_python`, the machinery of ``core-rl server-env``:
cached under ``$CORE_RL_HOME/server-envs/<name>-cpu-<hash>``), the adapter file the worker runs
(standard library and the library only: :mod:`core_rl_server_kit.worker_loop` describes its
interface and the JSON-lines protocol) and the adapter's options. :func:`shared_worker` starts one
:class:`Worker` per spec and process, on first use; requests from any thread or event loop go
over its pipes concurrently. :class:`WorkerEnvironment` is core-rl's
:class:`~core_rl.rollout.Environment` for one trajectory, its episode held in the shared worker
(a plugin's environment factory calls :func:`shared_worker`, so a worker that cannot start stops
the run at the first trajectory with its one-line error).

What goes wrong is said in one line naming the plugin: an adapter that fails to open (a bad
environment id) is a :class:`~core_rl.errors.ConfigError` naming the config key, as is a venv that
cannot be built; a worker that dies, or does not answer within its deadline, is a
:class:`WorkerFailed` with the last lines it wrote on stderr.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import itertools
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from core_rl.config.validators import positive
from core_rl.errors import ConfigError, CoreRLError
from core_rl.interfaces.servers import ServerEnvError, ServerEnvSpec
from core_rl.rollout import Action, Environment, StepResult

from core_rl_server_kit.env import create, env_python

LOOP_FILE = Path(__file__).with_name("worker_loop.py")
#: stderr lines of a worker kept for error messages
STDERR_TAIL = 20


class WorkerFailed(CoreRLError):
    """A library worker died, refused to start or did not answer in time (exit status 1)."""

    exit_code = 1


#: the last build step of a library's venv: the bytecode of every installed module, written once.
#: Where ``PYTHONDONTWRITEBYTECODE`` is set no worker would write it, and each would compile what it
#: imports again (verifiers: ~11 s a start instead of ~2 s)
COMPILE_STEP = (
    "-c",
    "import compileall, site, sys; "
    "sys.exit(not all(compileall.compile_dir(d, quiet=1, workers=0) for d in site.getsitepackages()))",
)


def library_env_spec(name: str, requirements: Sequence[str]) -> ServerEnvSpec:
    """The venv of a library's ``requirements``: one ``pip install`` of them, then their bytecode
    (:data:`COMPILE_STEP`); its hash (and so its directory) changes with them."""
    steps = [["-m", "pip", "install", *requirements], list(COMPILE_STEP)]
    return ServerEnvSpec(
        name=name, steps={"cpu": steps, "cuda": steps}, description=f"the {name} library's own environment"
    )


def library_python(name: str, python: str, requirements: Sequence[str], key: str) -> str:
    """The interpreter a library worker runs with: ``python`` where given (it must exist), else that
    of the venv built once from ``requirements`` (``core-rl server-env list`` shows it as ``name``).
    ``key`` is the config key path of those options, for the error a user can fix."""
    if python:
        path = Path(python).expanduser()
        if not path.is_file():
            raise ConfigError([f"{key}.python: no interpreter at {python!r}; give the path of a Python executable"])
        return str(path)
    if not requirements:
        raise ConfigError([f"{key}: set requirements (pip requirements of {name}'s venv) or python"])
    try:
        spec = library_env_spec(name, requirements)
        directory = create(spec, variant="cpu", echo=lambda line: print(line, flush=True))
    except ServerEnvError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError([f"{key}.requirements: {name}'s environment could not be built: {first}"]) from None
    return str(env_python(directory))


@attrs.frozen
class WorkerSpec:
    """One worker: ``who`` (the plugin, in messages, e.g. ``environment 'verifiers'``), ``key`` (the
    config key path of its options), ``python``, ``adapter`` (the file it runs), ``options`` (JSON,
    handed to the adapter's ``open_adapter``), ``path`` (directories put first on its
    ``PYTHONPATH``), ``start_timeout_s`` (how long opening the adapter may take) and
    ``call_timeout_s`` (how long one request may take)."""

    who: str
    key: str
    python: str
    adapter: str
    options: str  # JSON text: the spec is hashable, one worker per distinct spec
    path: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    call_timeout_s: float = 600.0


@attrs.define(kw_only=True)
class LibraryEnvOptions:
    """The options every library plugin's section has (a plugin's config class derives from it and
    gives ``requirements`` its pinned default): ``requirements`` (pip requirements of the library's
    venv), ``python`` (an interpreter to use instead, with the library installed), ``python_path``
    (directories put first on the worker's ``PYTHONPATH``, e.g. where a task's module lives) and
    ``start_timeout_s`` (how long the worker may take to open)."""

    requirements: list[str] = attrs.field(factory=list)
    python: str = ""
    python_path: list[str] = attrs.field(factory=list)
    start_timeout_s: float = attrs.field(default=300.0, validator=positive())

    def worker_spec(self, library: str, who: str, key: str, adapter: Path, options: Mapping[str, Any]) -> WorkerSpec:
        """The :class:`WorkerSpec` of these options: ``library`` names the venv, ``who`` and ``key``
        go in messages, ``adapter`` is the file the worker runs with ``options``. Builds the venv
        (once) unless ``python`` is given; made once per section object and ``who`` (a factory runs
        once per trajectory)."""
        cache_key = (id(self), who)
        hit = _SPECS.get(cache_key)
        if hit is None or hit[0] is not self:
            hit = _SPECS[cache_key] = (self, self._make_spec(library, who, key, adapter, options))
        return hit[1]

    def _make_spec(self, library: str, who: str, key: str, adapter: Path, options: Mapping[str, Any]) -> WorkerSpec:
        return WorkerSpec(
            who=who,
            key=key,
            python=library_python(library, self.python, self.requirements, key),
            adapter=str(adapter),
            options=json.dumps(dict(options), sort_keys=True),
            path=tuple(str(Path(p).expanduser().resolve()) for p in self.python_path),
            start_timeout_s=self.start_timeout_s,
        )


#: the specs :meth:`LibraryEnvOptions.worker_spec` made, by section object and ``who``
_SPECS: dict[tuple[int, str], tuple[LibraryEnvOptions, WorkerSpec]] = {}


class Worker:
    """A started worker process. :meth:`call` is thread-safe; :meth:`stop` ends it."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*spec.path, *filter(None, [env.get("PYTHONPATH", "")])])
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._dead: str | None = None
        self.process = subprocess.Popen(
            [spec.python, str(LOOP_FILE), spec.adapter],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        threading.Thread(target=self._read_stdout, name=f"{spec.who} stdout", daemon=True).start()
        threading.Thread(target=self._read_stderr, name=f"{spec.who} stderr", daemon=True).start()
        self._write(json.loads(spec.options))
        self._wait_ready()

    def _write(self, message: Mapping[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            with self._lock:
                self.process.stdin.write(json.dumps(message) + "\n")
                self.process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise WorkerFailed(self._death_note("it closed its input")) from None

    def _wait_ready(self) -> None:
        try:
            self._ready.result(timeout=self.spec.start_timeout_s)
        except concurrent.futures.TimeoutError:
            self.stop()
            raise WorkerFailed(
                f"{self.spec.who}: its worker ({self.spec.python}) did not open within "
                f"{self.spec.start_timeout_s:g} s; last stderr lines: {self._tail()}"
            ) from None

    def _tail(self) -> str:
        lines = [line for line in self._stderr if line.strip()]
        return " | ".join(lines[-5:]) or "none"

    def _death_note(self, how: str) -> str:
        code = self.process.poll()
        status = f"exit status {code}" if code is not None else "still running"
        where = f"{self.spec.who}: its worker ({self.spec.python})"
        return f"{where} failed: {how} ({status}); last stderr lines: {self._tail()}"

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                self._stderr.append(f"(not protocol) {line.rstrip()}")
                continue
            if "fatal" in message:
                self._ready.set_exception(
                    ConfigError([f"{self.spec.key}: {self.spec.who} could not open: {message['fatal']}"])
                )
            elif "ready" in message:
                self._ready.set_result(None)
            else:
                with self._lock:
                    future = self._pending.pop(message.get("id"), None)
                if future is not None:
                    future.set_result(message)
        self.process.wait()
        self._fail_all(self._death_note("it exited"))

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._stderr.append(line.rstrip())

    def _fail_all(self, note: str) -> None:
        with self._lock:
            self._dead = note
            pending, self._pending = self._pending, {}
        if not self._ready.done():
            self._ready.set_exception(WorkerFailed(note))
        for future in pending.values():
            future.set_exception(WorkerFailed(note))

    def submit(self, method: str, **params: Any) -> concurrent.futures.Future[Any]:
        """Send one request; the future holds its result, or raises :class:`WorkerFailed` (the
        worker died) or ``RuntimeError`` (the adapter raised: its one-line error)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                raise WorkerFailed(self._dead)
            ident = next(self._ids)
            self._pending[ident] = future
        self._write({"id": ident, "method": method, "params": params})
        answer: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def unpack(done: concurrent.futures.Future[Any]) -> None:
            if done.exception() is not None:
                answer.set_exception(done.exception())  # type: ignore[arg-type]
            elif "error" in done.result():
                answer.set_exception(RuntimeError(done.result()["error"]))
            else:
                answer.set_result(done.result().get("result"))

        future.add_done_callback(unpack)
        return answer

    def call(self, method: str, **params: Any) -> Any:
        """:meth:`submit`, waited for up to ``call_timeout_s`` (blocking: from a thread)."""
        try:
            return self.submit(method, **params).result(timeout=self.spec.call_timeout_s)
        except concurrent.futures.TimeoutError:
            raise WorkerFailed(
                f"{self.spec.who}: its worker did not answer {method} within {self.spec.call_timeout_s:g} s"
            ) from None

    async def acall(self, method: str, **params: Any) -> Any:
        """:meth:`submit`, awaited on the caller's event loop (the environment workflow's deadline
        applies; ``call_timeout_s`` bounds it otherwise)."""
        import asyncio

        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.submit(method, **params)), self.spec.call_timeout_s)
        except TimeoutError:
            raise WorkerFailed(
                f"{self.spec.who}: its worker did not answer {method} within {self.spec.call_timeout_s:g} s"
            ) from None

    def stop(self, grace_s: float = 10.0) -> None:
        """Close its input (the worker shuts down), then kill it if it is still there after ``grace_s``."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
            except OSError:
                pass
            deadline = time.monotonic() + grace_s
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


_WORKERS: dict[WorkerSpec, Worker] = {}
_WORKERS_LOCK = threading.Lock()


def shared_worker(spec: WorkerSpec) -> Worker:
    """The live worker of ``spec`` in this process, started on first use (and again after one died)."""
    with _WORKERS_LOCK:
        worker = _WORKERS.get(spec)
        if worker is None or worker.process.poll() is not None:
            worker = _WORKERS[spec] = Worker(spec)
        return worker


def stop_workers() -> None:
    """Stop every worker this process started (also run at exit)."""
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for worker in workers:
        worker.stop()


atexit.register(stop_workers)


_ROWS: dict[tuple[WorkerSpec, str], list[dict[str, Any]]] = {}


def worker_rows(spec: WorkerSpec, **params: Any) -> list[dict[str, Any]]:
    """The adapter's ``rows(**params)`` (a list of dicts, copied), from a worker started for the call
    and stopped after it; made once per process for the same spec and parameters (the same options
    make the same rows). An adapter error is a :class:`~core_rl.errors.ConfigError` naming the key."""
    key = (spec, json.dumps(params, sort_keys=True))
    if key not in _ROWS:
        worker = Worker(spec)
        try:
            _ROWS[key] = list(worker.call("rows", **params))
        except RuntimeError as exc:
            raise ConfigError([f"{spec.key}: {spec.who} could not make its rows: {exc}"]) from None
        finally:
            worker.stop()
    return [dict(row) for row in _ROWS[key]]


class WorkerEnvironment(Environment):
    """One trajectory whose episode lives in ``worker`` (shared by the trajectories of one config
    section: :func:`shared_worker`): ``reset(row)`` opens it (the adapter's ``reset(episode, row)``
    returns the first observation), each ``step`` sends the turn's text (the adapter's
    ``step(episode, text, turn)`` returns ``[observation, reward, done, info]``), ``close`` ends it."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.episode = uuid.uuid4().hex
        self._open = False

    async def reset(self, row: Mapping[str, Any]) -> str:
        observation = await self.worker.acall("reset", episode=self.episode, row=dict(row))
        self._open = True
        return str(observation)

    async def step(self, action: Action) -> StepResult:
        observation, reward, done, info = await self.worker.acall(
            "step", episode=self.episode, text=action.text, turn=action.turn
        )
        return StepResult(observation, reward, done, info)

    async def close(self) -> None:
        if self._open:
            self._open = False
            await self.worker.acall("close", episode=self.episode)
