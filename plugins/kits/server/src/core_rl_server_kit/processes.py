"""Inference servers as child processes: start, wait for health, tail logs, stop.

Every server plugin (vLLM, SGLang, ...) starts its servers through :class:`ManagedServer`, so
process handling lives here once. Each server runs under the supervisor of
:mod:`core_rl_server_kit.supervise`, which stops the server and every process it spawned when asked, when
the trainer exits, and when the trainer dies (even by ``SIGKILL``). The server's output goes to
its log file (in the run directory); errors quote the log's last lines.

Spawn servers from a thread that lives as long as they should: the kernel's parent-death signal
fires when the spawning *thread* exits.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from core_rl.errors import CoreRLError


class ServerError(CoreRLError):
    """A server failed to start, died, or did not answer in time: the run failed (exit status 1).
    The message names the server and quotes the tail of its log. ``recoverable``: the server ran
    and died; a new run from the last checkpoint may well succeed (``recover.mode: auto`` restarts
    it), unlike a server that cannot start or crashes on its first request."""

    exit_code = 1

    def __init__(self, message: str, *, recoverable: bool = False) -> None:
        super().__init__(message)
        self.recoverable = recoverable


#: how a start of a server begins in its log (the server's own lines follow)
START_MARK = "=== core-rl starts "
#: a Python exception line, maybe behind a process tag such as vLLM's "(EngineCore pid=12) "
_EXCEPTION_LINE = re.compile(r"^(?:\([^)]*\)\s+)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)\b:.*\S)")


def error_line(log_text: str) -> str | None:
    """The last exception line (``SomeError: what``) of a server's log text, from its last start on."""
    text = log_text[log_text.rfind(START_MARK) :] if START_MARK in log_text else log_text
    found = None
    for line in text.splitlines():
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            found = match.group(1)
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it). Another process may take it before the
    caller binds it: a server started on it that finds it taken says so
    (:meth:`ManagedServer.lost_its_port`), and its starter tries another."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_LIVE: weakref.WeakSet[ManagedServer] = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for server in list(_LIVE):
        server.stop()


atexit.register(_stop_all_at_exit)


class ManagedServer:
    """One server process started by core-rl on ``host:port``.

    :param name: how messages call it, e.g. ``vllm-0``.
    :param argv: the command (interpreter first).
    :param env: environment variables added to this process's environment.
    :param log_path: the server's output is appended here.
    :param health_path: HTTP path answering 200 once the server is ready.
    :param grace: seconds between SIGTERM and SIGKILL when stopping.
    :param cpus: CPU cores the server and its processes may run on (empty: any).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        host: str,
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        health_path: str = "/health",
        grace: float = 15.0,
        cpus: Sequence[int] = (),
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.host, self.port = host, port
        self.log_path = Path(log_path)
        self.first_log_path = self.log_path
        self.env = dict(env or {})
        self.health_path = health_path
        self.grace = grace
        self.cpus = list(cpus)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's own pid (not the supervisor's), once it is known."""
        try:
            return int(self.log_path.with_suffix(".pid").read_text())
        except (OSError, ValueError):
            return None

    def start(self, log_path: Path | None = None) -> None:
        """Start the server (under its supervisor); returns at once (see :meth:`wait_healthy`).
        ``log_path``: from now on the server's log (a restarted server's own, so that the log of
        the start that died is kept)."""
        with self._lock:
            if self.alive():
                return
            if log_path is not None:
                self.log_path = Path(log_path)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            pidfile = self.log_path.with_suffix(".pid")
            pidfile.unlink(missing_ok=True)
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(f"\n{START_MARK}{self.name} at {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n")
            cmd = [
                sys.executable,
                "-m",
                "core_rl_server_kit.supervise",
                "--parent",
                str(os.getpid()),
                "--log",
                str(self.log_path),
                "--pidfile",
                str(pidfile),
                "--grace",
                str(self.grace),
                "--cpus",
                ",".join(str(c) for c in self.cpus),
                "--",
                *self.argv,
            ]
            self._proc = subprocess.Popen(cmd, env={**os.environ, **self.env}, stdin=subprocess.DEVNULL)
            _LIVE.add(self)

    def alive(self) -> bool:
        """Whether the server process runs (its supervisor may outlive it by a moment)."""
        if self._proc is None or self._proc.poll() is not None:
            return False
        pid = self.pid
        return pid is None or pid_alive(pid)  # pid unknown: the server is still being started

    def exit_code(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    def wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the server to exit; whether it did."""
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def end_state(self) -> str:
        """How the server ended (``killed by signal 9 (SIGKILL)``, ``exited with status 1``), or
        ``still running``; waits a moment for its supervisor to report a server that is gone."""
        if self._proc is not None and self._proc.poll() is None and not self.alive():
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        code = self.exit_code()
        if code is None:
            return "still running"
        if code > 128:
            return f"killed by signal {code - 128} ({_signal_name(code - 128)})"
        return f"exited with status {code}"

    def failure(self, what: str, *, recoverable: bool = False) -> ServerError:
        """A :class:`ServerError` saying ``what`` happened to this server, how it ended, the last
        exception line of its log and the log's tail."""
        state = self.end_state()
        verb = "is" if state == "still running" else "was" if state.startswith("killed") else "has"
        line = error_line(tail(self.log_path, 400))
        said = f"; its error: {line}" if line else ""
        return ServerError(
            f"server {self.name} ({self.url}) {what}; it {verb} {state}{said}. Log {self.log_path}, last lines:\n"
            f"{self.log_tail()}",
            recoverable=recoverable,
        )

    def lost_its_port(self) -> bool:
        """Whether the server's log since its last start says its address was in use: another
        process took the port between :func:`free_port` choosing it and the server binding it."""
        text = tail(self.log_path, 400)
        text = text[text.rfind(START_MARK) :] if START_MARK in text else text
        return "address already in use" in text.lower()

    def healthy(self, timeout: float = 5.0) -> bool:
        """Whether the health endpoint answers 200 within ``timeout`` seconds."""
        return check_health(self.url + self.health_path, timeout)

    def wait_healthy(self, timeout: float) -> None:
        """Wait until the server answers its health check; raise :class:`ServerError` if it exits
        or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.failure("exited while starting")
            if self.healthy(timeout=2.0):
                return
            time.sleep(0.5)
        raise self.failure(f"did not become healthy within {timeout:.0f} s")

    def stop(self) -> None:
        """Stop the server and every process it spawned (SIGTERM, then SIGKILL after ``grace`` s).
        Idempotent."""
        with self._lock:
            proc, self._proc = self._proc, None
            _LIVE.discard(self)
            if proc is None:
                return
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=self.grace + 10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            pid = self.pid
            if pid is not None:  # the supervisor is gone; make sure its server is too
                from core_rl_server_kit.supervise import session_members

                for member in session_members(pid):
                    try:
                        os.kill(member, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return not os.path.isdir("/proc")  # no /proc entry on Linux: gone


def check_health(url: str, timeout: float = 5.0) -> bool:
    """Whether GET ``url`` answers 200 within ``timeout`` seconds."""
    return probe(url, timeout) is None


def probe(url: str, timeout: float = 5.0) -> str | None:
    """``None`` if GET ``url`` answers 200 within ``timeout`` seconds, else what went wrong
    (``connection refused``, ``answered 404``, ``no answer within 5 s``)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return None if response.status == 200 else f"answered {response.status}"
    except urllib.error.HTTPError as exc:
        return f"answered {exc.code}"
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused"
        if isinstance(reason, TimeoutError | socket.timeout):
            return f"no answer within {timeout:g} s"
        return str(reason)
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def wait_all_healthy(servers: Sequence[ManagedServer], timeout: float) -> None:
    """Wait for every server (they start in parallel); on failure stop them all and raise."""
    try:
        for server in servers:
            server.wait_healthy(timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
