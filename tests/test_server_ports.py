"""Servers core-rl starts on ports it chose (:func:`core_rl_server_kit.processes.free_port`): a port another
process takes before the server binds it costs a second start on another port, not the run."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from core_rl.config.converter import structure
from core_rl.interfaces import SamplingParams
from core_rl_server_kit.processes import START_MARK, ServerError, free_port
from core_rl_server_kit.remote import Completion, ServerOptions, ServerRolloutEngine, json_post
from core_rl_server_kit.remote import engine as remote_engine

#: a real server: binds its port (failing as any server does when the port is taken) and answers
#: ``GET /health`` and ``POST /gen``; a second argument makes it fail at start for another reason
SERVER = """
import http.server, json, sys, time
time.sleep(float(sys.argv[3]))  # loading its model
if sys.argv[2] == "broken":
    raise RuntimeError("the model does not fit")
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        body = json.dumps({"ids": [5, 6], "lps": [-0.5, -0.5]}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


class ScriptEngine(ServerRolloutEngine):
    """A server-backed engine over :data:`SERVER`; its ``k``-th start loads for ``load_s[k]``
    seconds (the last entry for later starts)."""

    env_name = "script"
    broken = False
    load_s: tuple[float, ...] = (0.0,)

    def server_command(self, python: str, port: int, index: int) -> list[str]:
        started = self.__dict__.get("starts", 0)
        self.starts = started + 1
        load = self.load_s[min(started, len(self.load_s) - 1)]
        return [python, "-c", SERVER, str(port), "broken" if self.broken else "ok", str(load)]

    async def request(self, client: Any, url: str, prompt_ids: list[int], sampling: SamplingParams) -> list[Completion]:
        body = await json_post(client, url + "/gen", {"prompt": prompt_ids})
        return [Completion(body["ids"], body["lps"], "length", None)] * sampling.n

    async def pause_server(self, client: Any, url: str, mode: str) -> None:
        raise AssertionError("not paused by these tests")

    resume_server = abort_all = reload_from_disk = join_weight_group = receive_weights = pause_server  # type: ignore[assignment]


@pytest.fixture
def taken():
    """A port another process holds (a listening socket of this one)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def _engine(tmp_path: Path, **options: Any) -> ScriptEngine:
    opts = structure({"python": sys.executable, "startup_timeout": 60, **options}, ServerOptions)
    return ScriptEngine("/models/none", opts, tmp_path)


def test_a_server_whose_chosen_port_was_taken_starts_again_on_another(tmp_path, taken, monkeypatch, capsys) -> None:
    chosen = iter([taken])
    monkeypatch.setattr(remote_engine, "free_port", lambda host: next(chosen, None) or free_port(host))
    engine = _engine(tmp_path)
    try:
        (endpoint,) = engine.endpoints
        assert not endpoint.url.endswith(f":{taken}")
        (samples,) = engine.generate([[1, 2]], SamplingParams(n=2, max_new_tokens=2))
        assert [s.response_ids for s in samples] == [[5, 6], [5, 6]]
    finally:
        engine.close()
    err = capsys.readouterr().err
    assert f"port {taken} was taken by another process" in err and endpoint.url.rsplit(":", 1)[1] in err
    log = (tmp_path / "servers" / "script-0.log").read_text()
    assert log.count(START_MARK) == 2 and "Address already in use" in log  # both starts' logs are kept


def test_a_start_again_has_a_whole_startup_timeout(tmp_path, taken, monkeypatch) -> None:
    """A server that notices its lost port only after loading for 9 of startup_timeout's 12 s
    still starts the second time, which loads for 4 s: the new start does not inherit what is left
    of the first's (at most 3 s), and has 8 s to spare for a loaded machine's Python start. (Both
    starts loading 6 s of a 10 s timeout left 4 s, and a CI run under load once needed more.)"""
    chosen = iter([taken])
    monkeypatch.setattr(remote_engine, "free_port", lambda host: next(chosen, None) or free_port(host))
    monkeypatch.setattr(ScriptEngine, "load_s", (9.0, 4.0))
    engine = _engine(tmp_path, startup_timeout=12)
    try:
        assert not engine.endpoints[0].url.endswith(f":{taken}")
    finally:
        engine.close()


def test_a_port_the_configuration_names_is_not_replaced(tmp_path, taken) -> None:
    with pytest.raises(ServerError, match="exited while starting.*Address already in use"):
        _engine(tmp_path, ports=[taken])
    assert (tmp_path / "servers" / "script-0.log").read_text().count(START_MARK) == 1


def test_a_server_failing_for_another_reason_is_not_started_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(ScriptEngine, "broken", True)
    with pytest.raises(ServerError, match="RuntimeError: the model does not fit"):
        _engine(tmp_path)
    assert (tmp_path / "servers" / "script-0.log").read_text().count(START_MARK) == 1
