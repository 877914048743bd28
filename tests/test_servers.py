"""Server processes (core_rl_server_kit.processes, core_rl_server_kit.supervise) with a small real HTTP server that
spawns a
child of its own, as inference servers do: health wait, logs, a clear error when a server dies, and
no process left behind on stop, on the trainer's exit and on the trainer's SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from core_rl.testing.processes import environment_of
from core_rl_server_kit.processes import ManagedServer, ServerError, free_port, pid_alive
from core_rl_server_kit.supervise import session_members

# an HTTP server answering 200 on /health that first starts a long-lived child process
SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            print("request", self.path, flush=True)

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def _server(tmp_path: Path, name: str = "fake-0", script: str = SERVER) -> ManagedServer:
    port = free_port()
    return ManagedServer(
        name,
        [sys.executable, "-c", script, str(port)],
        host="127.0.0.1",
        port=port,
        log_path=tmp_path / "servers" / f"{name}.log",
        grace=5,
    )


def test_start_health_log_and_stop_kills_children(tmp_path: Path) -> None:
    server = _server(tmp_path)
    server.start()
    try:
        server.wait_healthy(30)
        assert server.healthy()
        members = session_members(server.pid)
        assert server.pid in members and len(members) >= 2, members  # the server and its child
    finally:
        server.stop()
    assert _wait_gone(members) == []
    log = server.log_path.read_text()
    assert "child" in log and "request /health" in log
    server.stop()  # idempotent


# a server that binds a Unix socket in its runtime directory, as vLLM's and SGLang's launchers make theirs,
# and makes a file beside that directory which it lists for its supervisor to remove (SGLang's in /dev/shm)
SOCKET_SERVER = textwrap.dedent(
    """
    import http.server, os, socket, sys
    runtime = os.environ["CORE_RL_SERVER_RUNTIME_DIR"]
    path = os.path.join(runtime, "engine.sock")
    socket.socket(socket.AF_UNIX).bind(path)
    print("socket", path, flush=True)
    outside = runtime + ".shm"
    open(outside, "w").close()
    with open(os.path.join(runtime, "remove-when-gone"), "a") as listing:
        listing.write(outside + "\\n" + runtime + ".never-made" + "\\n")
    print("listed", outside, flush=True)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


@pytest.mark.parametrize("how", ["stop", "sigkill"])
def test_the_runtime_directory_goes_with_the_server(tmp_path: Path, how: str) -> None:
    """The supervisor gives the server a private directory for its sockets and removes it when the
    server is gone: after a stop, and after the server was killed outright. So it does with the files
    the server listed there as made elsewhere (one listed but never made is no error)."""
    server = _server(tmp_path, "sockets-0", SOCKET_SERVER)
    server.start()
    try:
        server.wait_healthy(30)
        lines = server.log_path.read_text().splitlines()
        socket_path = Path(next(x for x in lines if x.startswith("socket ")).split(" ", 1)[1])
        outside = Path(next(x for x in lines if x.startswith("listed ")).split(" ", 1)[1])
        assert socket_path.is_socket() and socket_path.parent.name.startswith("core-rl-")
        assert outside.is_file() and outside.parent == socket_path.parent.parent
        if how == "sigkill":
            os.kill(server.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while socket_path.parent.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        server.stop()
    assert not socket_path.parent.exists()
    assert not outside.exists()


def test_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    server = _server(tmp_path, "broken-0", "import sys; print('cannot load model xyz', flush=True); sys.exit(3)")
    server.start()
    with pytest.raises(ServerError) as info:
        server.wait_healthy(30)
    message = str(info.value)
    assert "broken-0" in message and "exited while starting" in message
    assert "cannot load model xyz" in message and "status 3" in message
    server.stop()


def test_health_timeout_names_the_server(tmp_path: Path) -> None:
    server = _server(tmp_path, "silent-0", "import time; time.sleep(600)")
    server.start()
    try:
        with pytest.raises(ServerError, match=r"silent-0 .* did not become healthy within 1 s"):
            server.wait_healthy(1)
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["sigkill", "exit", "sigterm"])
def test_no_orphans_when_the_trainer_goes(tmp_path: Path, how: str) -> None:
    """A trainer process starts a server, reports every pid, then dies by SIGKILL, exits normally
    (atexit), or is sent SIGTERM: every server process must go."""
    trainer = textwrap.dedent(
        f"""
        import json, sys, time
        from pathlib import Path
        from core_rl_server_kit.processes import ManagedServer, free_port
        from core_rl_server_kit.supervise import session_members
        port = free_port()
        s = ManagedServer("fake-0", [sys.executable, "-c", {SERVER!r}, str(port)], host="127.0.0.1",
                          port=port, log_path=Path({str(tmp_path)!r}) / "fake.log", grace=5)
        s.start()
        s.wait_healthy(30)
        while len(session_members(s.pid)) < 2:
            time.sleep(0.05)
        print(json.dumps([s._proc.pid, *session_members(s.pid)]), flush=True)
        if {how!r} == "exit":
            sys.exit(0)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        pids = json.loads(line)
        assert len(pids) >= 3 and all(pid_alive(p) for p in pids)
        if how == "sigkill":
            proc.kill()
        elif how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = _wait_gone(pids)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"left behind after {how}: {left}"


def test_a_server_does_not_outlive_its_supervisor_killed_outright(tmp_path: Path) -> None:
    """The supervisor SIGKILLed (as a Ray worker killed with its children can be) cannot stop the
    server's session itself: the server gets SIGTERM from the kernel (its parent-death signal)."""
    server = _server(tmp_path)
    server.start()
    try:
        server.wait_healthy(30)
        supervisor, served = server._proc.pid, server.pid
        assert pid_alive(served)
        runtime = Path(environment_of(served)["CORE_RL_SERVER_RUNTIME_DIR"])
        os.kill(supervisor, signal.SIGKILL)
        server._proc.wait(10)
        assert _wait_gone([served]) == [], "the server outlived its supervisor"
        # nobody is left to remove the server's runtime directory (vLLM's and SGLang's launchers do it themselves)
        assert runtime.is_dir()
    finally:
        server.stop()
        for pid in session_members(server.pid) if server.pid else []:
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(runtime)
