"""Inference servers as child processes: start, wait for health, tail logs, stop.

Every server plugin (vLLM, SGLang, ...) starts its servers through :class:`ManagedServer`, so
process handling lives here once. Each server runs under the supervisor of
:mod:`core_rl.supervise`, which stops the server and every process it spawned when asked, when
the trainer exits, and when the trainer dies (even by ``SIGKILL``). The server's output goes to
its log file (in the run directory); errors quote the log's last lines.

Spawn servers from a thread that lives as long as they should: the kernel's parent-death signal
fires when the spawning *thread* exits.
"""

from __future__ import annotations

import atexit
import os
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
    """A server failed to start, died, or did not answer in time. The message names the server and
    quotes the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
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

    def start(self) -> None:
        """Start the server (under its supervisor); returns at once (see :meth:`wait_healthy`)."""
        with self._lock:
            if self.alive():
                return
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            pidfile = self.log_path.with_suffix(".pid")
            pidfile.unlink(missing_ok=True)
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(f"\n=== core-rl starts {self.name} at {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n")
            cmd = [
                sys.executable,
                "-m",
                "core_rl.supervise",
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

    def failure(self, what: str) -> ServerError:
        """A :class:`ServerError` saying ``what`` happened to this server, with its log's tail."""
        if self._proc is not None and self._proc.poll() is None and not self.alive():
            try:  # the server is gone: its supervisor reports its status within moments
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        code = self.exit_code()
        state = f"exited with status {code}" if code is not None else "is running"
        return ServerError(
            f"server {self.name} ({self.url}) {what}; it {state}. Log {self.log_path}, last lines:\n{self.log_tail()}"
        )

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
                from core_rl.supervise import session_members

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
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_all_healthy(servers: Sequence[ManagedServer], timeout: float) -> None:
    """Wait for every server (they start in parallel); on failure stop them all and raise."""
    try:
        for server in servers:
            server.wait_healthy(timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
