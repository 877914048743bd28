"""A tiny supervisor that keeps one server process (and every process it spawns) tied to the
trainer's life: ``python -m core_rl_server_kit.supervise --parent PID --log FILE --pidfile FILE -- CMD...``.

The trainer starts this supervisor; the supervisor starts ``CMD`` in a new session (so the server
and all its children share a session id) with stdout and stderr appended to ``FILE``, and then:

- asks the kernel for ``SIGTERM`` when the trainer dies (``PR_SET_PDEATHSIG``), and also polls
  its parent pid, so a trainer killed with ``SIGKILL`` still takes its servers down;
- on ``SIGTERM``/``SIGINT``/``SIGHUP`` or the trainer's death, stops the server's whole session:
  ``SIGTERM`` to every process in it, then ``SIGKILL`` to what is left after ``--grace`` seconds;
- when the server exits on its own, kills what remains of its session and exits with its status;
- if the supervisor itself is killed outright (``SIGKILL``: a Ray worker killed with its children,
  the OOM killer), the server gets ``SIGTERM`` from the kernel (its own parent-death signal), so it
  never outlives both.

The server also gets a private directory for its runtime files, named in ``CORE_RL_SERVER_RUNTIME_DIR``
(a short path under the system's temporary directory, as Unix socket paths must be short). The
server-side launchers put their inter-process sockets there (vLLM's ZMQ paths, SGLang's IPC names),
which a killed server would otherwise leave in ``/tmp``; the supervisor removes it once the server's
session is gone. A supervisor killed outright cannot; vLLM's and SGLang's launchers also remove it
when their server exits (on the ``SIGTERM`` the kernel sends it then). Files a server has to make
elsewhere (SGLang's load report in ``/dev/shm``) it names, one path per line, in the runtime
directory's ``remove-when-gone`` (:data:`LEFTOVERS_FILE`); the supervisor removes those too.

It imports nothing heavy (it runs before and beside the servers, in the trainer's interpreter).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

PR_SET_PDEATHSIG = 1
#: the environment variable naming the server's private runtime directory
RUNTIME_DIR_VARIABLE = "CORE_RL_SERVER_RUNTIME_DIR"
#: the file in the runtime directory where the server lists, one path per line, files it made outside
#: that directory, for the supervisor to remove once the server's session is gone
LEFTOVERS_FILE = "remove-when-gone"


def _set_parent_death_signal(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent-pid poll still works
        pass


def session_members(sid: int) -> list[int]:
    """Pids of the live processes whose session id is ``sid`` (Linux ``/proc``)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) == sid:
                members.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return members


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_session(server: subprocess.Popen, grace: float) -> None:
    """SIGTERM every process of the server's session, wait up to ``grace`` s, then SIGKILL the rest."""
    sid = server.pid  # the server is its session's leader
    _signal_all([server.pid, *session_members(sid)], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        server.poll()
        if not [p for p in session_members(sid) if p != os.getpid()] and server.returncode is not None:
            return
        time.sleep(0.1)
    _signal_all([server.pid, *session_members(sid)], signal.SIGKILL)
    try:
        server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def remove_leftovers(runtime: str) -> None:
    """Remove the files the server listed in ``runtime``'s :data:`LEFTOVERS_FILE` (a file already gone,
    or a list never written, is no error)."""
    try:
        with open(os.path.join(runtime, LEFTOVERS_FILE)) as listing:
            paths = [line.strip() for line in listing if line.strip()]
    except OSError:
        return
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core_rl_server_kit.supervise")
    parser.add_argument("--parent", type=int, required=True, help="pid of the trainer; its death stops the server")
    parser.add_argument("--log", required=True, help="file the server's output is appended to")
    parser.add_argument("--pidfile", help="file to write the server's pid to")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--cpus", default="", help="comma-separated CPU cores the server may run on (empty: any)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no server command given")

    _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != args.parent:  # the trainer died before the death signal was armed
        return 1
    stop_requested = False

    def request_stop(_signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, request_stop)

    if args.cpus:  # inherited by the server and every process it starts
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    supervisor = os.getpid()

    def die_with_supervisor() -> None:  # in the server's process, between fork and exec
        _set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != supervisor:  # the supervisor died before the signal was armed
            os._exit(1)

    with (
        tempfile.TemporaryDirectory(prefix="core-rl-", ignore_cleanup_errors=True) as runtime,
        open(args.log, "ab", buffering=0) as log,
    ):
        server = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_supervisor,
            env={**os.environ, RUNTIME_DIR_VARIABLE: runtime},
        )
        if args.pidfile:
            with open(args.pidfile, "w") as handle:
                handle.write(str(server.pid))
        while True:
            if stop_requested or os.getppid() != args.parent:
                stop_session(server, args.grace)
                remove_leftovers(runtime)
                return 0
            code = server.poll()
            if code is not None:
                stop_session(server, 2.0)  # what the server left behind
                remove_leftovers(runtime)
                return code if code >= 0 else 128 - code
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
