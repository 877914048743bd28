"""Python processes for tests, forked from an interpreter that has already imported torch and
transformers.

A test that runs ``core-rl train`` (or an example's ``main.py``) in a process of its own pays for
importing torch and transformers each time: ~6 CPU seconds, most of a tiny run's cost and a fifth
of a real model's. On the 2-core machines the suite runs on, that is a large share of its wall time.
:func:`Popen` and :func:`run` take the same arguments as :mod:`subprocess`'s, and where the command
is ``sys.executable ...`` they start a real child process forked from a *preloaded* interpreter:
one per pytest worker (and per import-time environment, below) that imported those libraries once,
then only waits for requests and forks. Any other command goes to :mod:`subprocess` unchanged.

The child is an ordinary process: its own pid and process group (its own session with
``start_new_session``), the requested environment, working directory, ``sys.argv`` and standard
streams (the very pipes or files the caller asked for, passed over a Unix socket), running the
module (``-m``) or script as ``__main__`` and ending through the interpreter's normal exit
(``atexit`` handlers, non-daemon threads joined, the status from ``SystemExit``, or 1 after an
uncaught exception's traceback). Signals sent to its pid reach it. What differs from a fresh
``python``:

- what the preloaded imports fixed when they ran: the environment they read then (core-rl's own
  modules among them, :data:`PRELOAD_CORE_RL`, read none), so variables
  whose names start with one of :data:`IMPORT_TIME_PREFIXES` (``HF_``, ``TORCH``, ``OMP_``,
  ``PYTHON``...) key the preloaded interpreter, and a request whose values differ from every
  running one's gets one of its own; and the string hash seed, shared by one interpreter's children;
- what was imported before the fork is frozen out of the garbage collector's sight (``gc.freeze``):
  a child's collections walk only the objects it made;
- its parent is the preloaded interpreter, which reaps it; ``/proc/PID/cmdline`` (what ``ps``
  shows) and ``/proc/PID/environ`` are the interpreter's (``sys.argv`` and ``os.environ`` are the
  requested ones).

Workers of torch's elastic agent (``torchrun``, the ``local`` launcher's ``--nproc-per-node``) come
from the same interpreter when the agent is itself one of its children: the interpreter also
listens on a socket of its own, and in its children the agent's ``SubprocessHandler._popen`` asks it
to fork each worker there (with the environment the worker would get; a worker whose import-time
variables differ from the interpreter's starts with :mod:`subprocess`). A worker is then a child of
the interpreter, not of the agent, and the interpreter reaps it as it exits: the agent's signal to
the process group of a worker that ended after its last poll finds no group (a child of the agent's
own would still be there, a zombie, until the agent reaps it), which the handler takes as
``subprocess`` would, as a signal to a process already gone. A test that finds workers in the
agent's process tree, or reads their ``/proc/PID/environ``, gives the agent
``CORE_RL_TEST_PRELOAD=0`` so that its workers start fresh.

``CORE_RL_TEST_PRELOAD=0`` sends every command to :mod:`subprocess`. Tests of the console script, or
of what an import does at start-up, start their processes with :mod:`subprocess` themselves.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: the third-party libraries the preloaded interpreter imports before it forks anything (then
#: :data:`PRELOAD_CORE_RL`)
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.utils.type_validators",
    "safetensors.torch",
    "yaml",
    "omegaconf",
    "pluggy",
    "attrs",
    "cattrs",
)

#: core-rl's own modules that every ``core-rl train`` imports (the configuration, the run and the RL
#: loop, the plugin host), imported after :data:`PRELOAD`: ~0.3 CPU s less per child. None of them,
#: nor what they import, reads the environment at import (``tests/test_preloaded.py`` checks it: a
#: child sets its own environment only after the fork) or is a module tests run as ``-m`` (runpy
#: would warn that it was imported before it ran as ``__main__``)
PRELOAD_CORE_RL = (
    "core_rl.config.loader",
    "core_rl.plugins.host",
    "core_rl.launch.rendezvous",
    "core_rl.loops.run",
    "core_rl.loops.rl.loop",
)

#: environment variables read when :data:`PRELOAD` is imported (the name starts with one of these):
#: they must have the request's values when the interpreter starts, so they key it
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "SAFETENSORS",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL",
    "KMP_",
    "OPENBLAS",
    "CUDA",
    "NCCL",
    "PYTHON",
    "USE_",
    "XDG_",
    "LD_",
)

#: variables under :data:`IMPORT_TIME_PREFIXES` that are read only at run time: torch's elastic agent
#: sets them for each worker, and they must not keep a worker from its agent's interpreter
RUN_TIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")

PRELOAD_ENV = "CORE_RL_TEST_PRELOAD"
_MESSAGE_BYTES = 1 << 20
#: how often the preloaded interpreter looks for ended children while it has some
_REAP_INTERVAL_S = 0.05

#: the CPU seconds of the children forked so far for this process (and of the processes they reaped):
#: a preloaded interpreter reaps them, so they never reach this process's ``os.times().children_*``
forked_cpu_seconds = 0.0


def import_time_environment(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The items of ``env`` that :data:`PRELOAD` reads at import: what keys a preloaded interpreter."""
    return tuple(
        sorted(
            (k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(RUN_TIME_PREFIXES)
        )
    )


class Unforkable(RuntimeError):
    """The preloaded imports left the interpreter in a state its children cannot start from (CUDA
    initialised): the commands with its environment go to :mod:`subprocess`."""


class Channel:
    """A connection to a preloaded interpreter: fork requests go out on ``sock``; the pids forked and
    the exit statuses of the children that ended come back, read by a thread of its own."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self.spawn_lock = threading.Lock()
        self.changed = threading.Condition()
        self.forked: list[int] = []
        self.refused: list[str] = []
        self.ended: dict[int, int] = {}
        self.gone: str | None = None
        threading.Thread(target=self._read_replies, name="preloaded-replies", daemon=True).start()

    def alive(self) -> bool:
        return self.gone is None

    def _ended_why(self) -> str:
        return "the preloaded interpreter ended"

    def _read_replies(self) -> None:
        global forked_cpu_seconds
        while True:
            try:
                data = self.socket.recv(_MESSAGE_BYTES)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    self.gone = self._ended_why()
                    self.changed.notify_all()
                    return
                reply = json.loads(data)
                if "forked" in reply:
                    self.forked.append(reply["forked"])
                elif "refused" in reply:
                    self.refused.append(reply["refused"])
                else:
                    if "pid" in reply:  # not there: a worker another channel asked for, counted here
                        self.ended[reply["pid"]] = reply["returncode"]
                    forked_cpu_seconds += reply["cpu_s"]
                self.changed.notify_all()

    def spawn(self, args: Sequence[str], env: Mapping[str, str], cwd: str, fds: Sequence[int], session: bool) -> int:
        """Fork a child running ``python ARGS`` with ``fds`` as its stdin, stdout and stderr; its pid.
        :class:`Unforkable` if the interpreter will not fork with ``env``."""
        request = {"args": list(args), "env": dict(env), "cwd": cwd, "session": session}
        with self.spawn_lock:
            socket.send_fds(self.socket, [json.dumps(request).encode()], list(fds))
            with self.changed:
                if not self.changed.wait_for(lambda: self.forked or self.refused or self.gone, timeout=60):
                    raise RuntimeError("the preloaded interpreter did not fork within 60 s")
                if self.refused:
                    raise Unforkable(self.refused.pop(0))
                if self.gone:
                    raise RuntimeError(self.gone)
                return self.forked.pop(0)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it has ended, waiting at most ``timeout`` s (``None``: for
        as long as it takes); ``None`` if it has not ended by then."""
        with self.changed:
            self.changed.wait_for(lambda: pid in self.ended or self.gone, timeout=timeout)
            if pid not in self.ended and self.gone:
                raise RuntimeError(self.gone)
            return self.ended.get(pid)


class PreloadedInterpreter(Channel):
    """One preloaded interpreter (``python .../core_rl/testing/preloaded.py FD``: run as a script, so
    that core-rl's package is imported only by :data:`PRELOAD_CORE_RL`, whose modules read no
    environment at import) started with ``env``, and the channel to it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_fd, log_name = tempfile.mkstemp(prefix="core-rl-preloaded-", suffix=".log")
        self.log = Path(log_name)
        with os.fdopen(log_fd, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno())],  # a script, not core_rl.testing.preloaded
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=dict(env),
                start_new_session=True,  # a ^C to the test run reaches pytest, which closes this
            )
        theirs.close()
        ours.settimeout(300)
        try:
            try:
                answer = json.loads(ours.recv(_MESSAGE_BYTES) or b"{}")
            except TimeoutError:
                answer = {}
            if "unforkable" in answer:
                self.process.wait()
                raise Unforkable(answer["unforkable"])
            if answer.get("ready") is not True:
                self.process.kill()
                raise RuntimeError(
                    f"the preloaded interpreter did not start within 300 s (status {self.process.wait()}); "
                    f"its stderr:\n{self.log.read_text()[-3000:]}"
                )
        finally:
            self.log.unlink()  # it only ever holds the start's errors: nothing is left behind in /tmp
        ours.settimeout(None)
        super().__init__(ours)

    def _ended_why(self) -> str:
        return f"the preloaded interpreter ended (status {self.process.poll()})"

    def close(self) -> None:
        self.socket.close()  # the interpreter ends its children's process groups and exits
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_interpreters: dict[tuple[tuple[str, str], ...], PreloadedInterpreter] = {}
_interpreters_lock = threading.Lock()
_unforkable: dict[tuple[tuple[str, str], ...], str] = {}
_interpreters_owner = os.getpid()  # a process forked from this one starts interpreters of its own


@atexit.register
def _close_all() -> None:
    if os.getpid() != _interpreters_owner:
        return
    for interpreter in _interpreters.values():
        interpreter.close()


def _interpreter(env: Mapping[str, str]) -> PreloadedInterpreter:
    global _interpreters_owner
    key = import_time_environment(env)
    with _interpreters_lock:
        if os.getpid() != _interpreters_owner:
            _interpreters.clear()
            _interpreters_owner = os.getpid()
        interpreter = _interpreters.get(key)
        if interpreter is None or not interpreter.alive():
            try:
                interpreter = _interpreters[key] = PreloadedInterpreter(env)
            except Unforkable as why:
                _unforkable[key] = str(why)
                raise
        return interpreter


def _preloadable(args: Any, kwargs: Mapping[str, Any]) -> bool:
    supported = {"stdin", "stdout", "stderr", "env", "cwd", "text", "universal_newlines", "start_new_session"}
    return (
        os.environ.get(PRELOAD_ENV, "1") != "0"
        and hasattr(os, "fork")
        and isinstance(args, (list, tuple))
        and len(args) > 1
        and str(args[0]) == sys.executable
        and set(kwargs) <= supported
        and _runs_a_module_or_script([str(a) for a in args[1:]])
        and import_time_environment(kwargs.get("env") or os.environ) not in _unforkable
    )


def _runs_a_module_or_script(args: list[str]) -> bool:
    """Whether ``python ARGS`` is ``[-u] -m MODULE ...`` or ``[-u] SCRIPT ...``, what a preloaded
    interpreter's child runs (other interpreter options are for a fresh one)."""
    if args[:1] == ["-u"]:
        args = args[1:]
    return bool(args) and ((args[0] == "-m" and len(args) > 1) or not args[0].startswith("-"))


class PreloadedPopen:
    """A child of a preloaded interpreter, with :class:`subprocess.Popen`'s attributes and methods
    that tests use: ``args``, ``pid``, ``returncode``, ``stdin``/``stdout``/``stderr``,
    :meth:`poll`, :meth:`wait`, :meth:`communicate`, :meth:`send_signal`, :meth:`terminate`,
    :meth:`kill`, and use as a context manager."""

    def __init__(
        self,
        args: Sequence[Any],
        *,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        text: bool = False,
        universal_newlines: bool = False,
        start_new_session: bool = False,
        channel: Channel | None = None,
    ) -> None:
        """``channel``: the interpreter to fork from (default: this process's for ``env``)."""
        self.args = list(args)
        self.returncode: int | None = None
        text = text or universal_newlines
        env = dict(os.environ if env is None else env)
        cwd = str(Path(cwd if cwd is not None else os.getcwd()).resolve())
        self._interpreter = channel or _interpreter(env)  # before any pipe: Unforkable leaves nothing open
        theirs: list[int] = []
        close_after: list[int] = []
        self.stdin: IO | None = None
        self.stdout: IO | None = None
        self.stderr: IO | None = None
        for number, how in ((0, stdin), (1, stdout), (2, stderr)):
            if how is subprocess.PIPE:
                read, write = os.pipe()
                mine, child = (write, read) if number == 0 else (read, write)
                stream = os.fdopen(mine, "wb" if number == 0 else "rb")
                if text:
                    stream = io.TextIOWrapper(stream, write_through=number == 0)
                setattr(self, ("stdin", "stdout", "stderr")[number], stream)
                theirs.append(child)
                close_after.append(child)
            elif how is subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                theirs.append(fd)
                close_after.append(fd)
            elif how is subprocess.STDOUT and number == 2:
                theirs.append(theirs[1])
            elif how is None:
                theirs.append(number)
            else:
                theirs.append(how if isinstance(how, int) else how.fileno())
        try:
            self.pid = self._interpreter.spawn(
                [os.fspath(a) for a in self.args[1:]], env, cwd, theirs, start_new_session
            )
        except BaseException:
            for stream in (self.stdin, self.stdout, self.stderr):
                if stream is not None:
                    stream.close()
            raise
        finally:
            for fd in close_after:
                os.close(fd)
        self._readers: dict[str, threading.Thread] = {}
        self._read: dict[str, list] = {"stdout": [], "stderr": []}

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._interpreter.returncode(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._interpreter.returncode(self.pid, timeout=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """As :meth:`subprocess.Popen.communicate`: ``input`` to stdin (then closed), stdout and
        stderr read to their end, the process waited for; ``TimeoutExpired`` after ``timeout`` s
        (a later call goes on reading)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None and not self.stdin.closed:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                reader = threading.Thread(target=lambda s=stream, n=name: self._read[n].append(s.read()), daemon=True)
                reader.start()
                self._readers[name] = reader
        for reader in self._readers.values():
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        outputs = []
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is None:
                outputs.append(None)
            else:
                stream.close()
                outputs.append(self._read[name][0])
        return outputs[0], outputs[1]

    def __enter__(self) -> PreloadedPopen:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _kill_group(pid: int) -> None:
    """SIGKILL to the process group (or session) that ``pid`` leads, if it is still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _preloaded_popen(args: Any, kwargs: Mapping[str, Any]) -> PreloadedPopen | None:
    """``args`` started from a preloaded interpreter; ``None`` where :mod:`subprocess` is to start it."""
    if not _preloadable(args, kwargs):
        return None
    try:
        return PreloadedPopen(args, **kwargs)
    except Unforkable:
        return None


def Popen(args: Any, **kwargs: Any) -> PreloadedPopen | subprocess.Popen:
    """:class:`subprocess.Popen` ``(args, **kwargs)``, forked from a preloaded interpreter where
    ``args`` is ``[sys.executable, ...]`` and only ``stdin``, ``stdout``, ``stderr``, ``env``,
    ``cwd``, ``text`` or ``start_new_session`` are given (the module docstring)."""
    return _preloaded_popen(args, kwargs) or subprocess.Popen(args, **kwargs)


def run(
    args: Any,
    *,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    input: Any = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """:func:`subprocess.run`, its process from :func:`Popen`. On ``timeout`` the process's group
    (or session) is killed, as a test wants of what it started."""
    if capture_output:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        kwargs.setdefault("stdin", subprocess.PIPE)
    process = _preloaded_popen(args, kwargs)
    if process is None:
        return subprocess.run(args, timeout=timeout, check=check, input=input, **kwargs)
    with process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            out, err = process.communicate()
            raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err) from None
    completed = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        completed.check_returncode()
    return completed


# -- the preloaded interpreter's side ------------------------------------------------------------


def _fill_caches() -> None:
    """Fill the process-wide caches every child would fill the same way on its first model load:
    transformers' table of checkpoint key conversions (built from ~1,000 regular expressions, 0.3
    CPU s). A transformers without it is left as it is."""
    try:
        from transformers import conversion_mapping

        conversion_mapping.get_checkpoint_conversion_mapping("llama")
    except (ImportError, AttributeError):
        pass


def _serve(channel: socket.socket) -> tuple[dict, list[int]] | None:
    """Import :data:`PRELOAD`, then fork a child per request, replying ``{"forked": pid}`` when it
    is forked and ``{"pid", "returncode", "cpu_s"}`` when it has ended. Requests come on ``channel``
    (the test process's) and on the connections its children's elastic agents make to a listening
    socket (:func:`_fork_workers_from`); the CPU seconds of the workers they asked for are also sent
    on ``channel``. Returns in the child, with its request and descriptors; ``None`` in the
    interpreter once ``channel`` closes."""
    import importlib

    own_key = import_time_environment(os.environ)  # as started: the imports may set variables
    for name in (*PRELOAD, *PRELOAD_CORE_RL):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    _fill_caches()
    # Everything imported so far lives as long as the interpreter: out of the collector's sight, a
    # child's gc.collect() (engines call it when they close) walks only what the child made, not the
    # ~1M objects of torch and transformers (0.3 CPU s a call)
    gc.collect()
    gc.freeze()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        why = "importing the preloaded libraries initialised CUDA, which a forked child cannot use"
        channel.send(json.dumps({"unforkable": why}).encode())
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(f"\0core-rl-preloaded-{os.getpid()}-{os.urandom(6).hex()}")  # Linux's abstract names
    listener.listen(16)
    _fork_workers_from(listener.getsockname())
    channel.send(json.dumps({"ready": True}).encode())
    connections: list[socket.socket] = [channel]
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    while True:
        readable, _, _ = select.select([listener, *connections], [], [], _REAP_INTERVAL_S if children else None)
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            cpu_s = usage.ru_utime + usage.ru_stime
            asker = children.pop(pid)
            _reply(asker, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status), "cpu_s": cpu_s})
            if asker is not channel:
                _reply(channel, {"cpu_s": cpu_s})
        for connection in readable:
            if connection is listener:
                connections.append(listener.accept()[0])
                continue
            try:
                message, fds, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, 3)
            except OSError:
                message, fds = b"", []
            if not message:
                if connection is channel:
                    for pid in children:  # the test process has gone: so does what it started
                        _kill_group(pid)
                    return None
                connections.remove(connection)  # an agent ended; its workers stay, as a fresh one's would
                connection.close()
                continue
            request = json.loads(message)
            if import_time_environment(request["env"]) != own_key:
                for fd in fds:
                    os.close(fd)
                _reply(connection, {"refused": "its import-time environment differs from the preloaded interpreter's"})
                continue
            pid = os.fork()
            if pid == 0:
                for sock in (listener, *connections):
                    sock.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            children[pid] = connection
            _reply(connection, {"forked": pid})


def _reply(connection: socket.socket, message: dict) -> None:
    """``message`` to whoever is at the other end of ``connection``, if anyone still is (an agent
    may have been killed with requests in flight; the test process's end is noticed as its EOF)."""
    try:
        connection.send(json.dumps(message).encode())
    except OSError:
        pass


def _fork_workers_from(address: str) -> None:
    """In the preloaded interpreter (and so in every child): torch's elastic agent starts each
    ``python`` worker as a child of the interpreter at ``address`` (listening for the agent's
    connection), and any other command, or any the interpreter refuses, as torch does."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    except ImportError:
        return
    torch_popen = subprocess_handler.SubprocessHandler._popen
    agent: dict[int, Channel] = {}  # this agent's channel, by the pid of the agent that made it

    def popen(handler: Any, args: tuple, env: dict[str, str]) -> Any:
        kwargs = {"stdout": handler._stdout, "stderr": handler._stderr, "env": env, "start_new_session": True}
        if not _preloadable(list(args), kwargs):
            return torch_popen(handler, args, env)
        try:
            if os.getpid() not in agent or not agent[os.getpid()].alive():
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                connection.connect(address)
                agent.clear()
                agent[os.getpid()] = Channel(connection)
            return PreloadedPopen(args, channel=agent[os.getpid()], **kwargs)
        except (Unforkable, OSError):
            return torch_popen(handler, args, env)

    torch_close = subprocess_handler.SubprocessHandler.close

    def close(handler: Any, death_sig: Any = None) -> None:
        # a worker the interpreter reaped between the agent's poll and its killpg (see the module
        # docstring): what torch's close does after the signal, without the signal
        try:
            torch_close(handler, death_sig)
        except ProcessLookupError:
            if not isinstance(handler.proc, PreloadedPopen):
                raise
            for stream in (handler._stdout, handler._stderr):
                if stream:
                    stream.close()

    subprocess_handler.SubprocessHandler._popen = popen
    subprocess_handler.SubprocessHandler.close = close


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: take a process group (or session) of its own, the request's streams,
    environment, directory and argv, then run its module or script as ``__main__``."""
    import runpy

    if request["session"]:
        os.setsid()
    else:
        os.setpgid(0, 0)
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    args = request["args"]
    if args[0] == "-u":  # unbuffered standard streams
        args = args[1:]
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # runpy puts the module's path in argv[0]
        sys.path[0] = request["cwd"]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = str(Path(args[0]).resolve().parent)
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    del sys.path[0]  # this file's folder, which no import is to search
    served = _serve(socket.socket(fileno=int(sys.argv[1])))
    if served is not None:
        _become(*served)
