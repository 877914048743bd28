"""``server.cpus``: a started server and every process it spawns run on exactly the given cores
(the fake HTTP server of test_servers.py, which starts a child as inference servers do); a core
the machine lacks is a configuration error naming the key (the vLLM plugin's own tests check that
it binds its OpenMP threads to those cores)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from core_rl_server_kit.processes import ManagedServer, free_port
from core_rl_server_kit.supervise import session_members
from test_servers import SERVER


def allowed_cores(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


def test_server_and_its_children_run_on_the_given_cores(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    want = {cores[-1]}
    port = free_port()
    server = ManagedServer(
        "fake-0",
        [sys.executable, "-c", SERVER, str(port)],
        host="127.0.0.1",
        port=port,
        log_path=tmp_path / "fake-0.log",
        grace=5,
        cpus=sorted(want),
    )
    server.start()
    try:
        server.wait_healthy(30)
        members = session_members(server.pid)
        assert len(members) >= 2  # the server and its child
        assert all(allowed_cores(pid) == want for pid in members)
    finally:
        server.stop()
    assert os.sched_getaffinity(0) == set(cores)  # the trainer's own cores are untouched


def test_a_core_the_machine_lacks_is_a_config_error() -> None:
    from core_rl.config.loader import structure
    from core_rl.errors import ConfigError
    from core_rl_server_kit.remote import ServerOptions

    assert structure({"cpus": [0]}, ServerOptions).cpus == [0]
    with pytest.raises(ConfigError, match=r"server\.cpus|cpus: cores \[4096\] do not exist"):
        structure({"cpus": [0, 4096]}, ServerOptions)
