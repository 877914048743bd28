"""An HTTP server that records every request and answers from a script: a stand-in for an
inference server where the real one cannot run (vLLM's and SGLang's sleep modes need CUDA), to
check the exact requests a server-backed rollout engine sends, in order, and what it does with an
error answer. It checks nothing about the real server's behaviour: the real servers are exercised
by the plugins' conformance and GPU tests.

    with RecordingServer({"/sleep": (500, {"error": "no"})}) as server:
        with engine_on(server, VLLMRolloutEngine, VLLMConfig, run_dir, sleep=True) as engine:
            ...
        assert server.paths("POST") == ["/sleep?level=2"]
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs

#: a scripted answer: ``(status, JSON body)``, or a function of the request's JSON body returning one
Answer = tuple[int, Any] | Callable[[Any], tuple[int, Any]]


@attrs.frozen
class Recorded:
    """One request: ``method``, ``path`` (with its query string) and its JSON ``body`` (``None`` when empty)."""

    method: str
    path: str
    body: Any


class QuietHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server for tests that does not print a traceback when a client went away
    before its answer (a request the test timed out or cancelled): a handler thread that outlives
    its test would otherwise print it into whichever test runs next in the process."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)


class RecordingServer:
    """Serves on 127.0.0.1 (a free port) until :meth:`close`; answers a request whose path (without
    the query) is in ``answers`` from it, any other with status 200 and ``{}``. ``requests`` holds
    every request received, in order of arrival."""

    def __init__(self, answers: Mapping[str, Answer] | None = None) -> None:
        self.answers: dict[str, Answer] = dict(answers or {})
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._server = QuietHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="recording-server", daemon=True)
        self._thread.start()

    def paths(self, method: str | None = None) -> list[str]:
        """The paths (with query strings) requested so far, of ``method`` only if given."""
        with self._lock:
            return [r.path for r in self.requests if method is None or r.method == method]

    def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """Record a request and pick its answer."""
        with self._lock:
            self.requests.append(Recorded(method, path, body))
            scripted = self.answers.get(path.split("?", 1)[0])
        if scripted is None:
            return 200, {}
        return scripted(body) if callable(scripted) else scripted

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> RecordingServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def engine_on(
    server: RecordingServer, engine_cls: type, config_cls: type, run_dir: Path, **kwargs: Any
) -> Iterator[Any]:
    """A server-backed engine of ``engine_cls`` (built from a default ``config_cls`` section) using
    ``server`` by URL, one HTTP request per generation request (``batch_window_s: 0``); closed after."""
    from core_rl.config.loader import structure

    config = structure({"server": {"urls": [server.url], "batch_window_s": 0}}, config_cls, path="rollout.engine")
    engine = engine_cls("/models/none", config, run_dir, **kwargs)
    try:
        yield engine
    finally:
        engine.close()


def send_json(handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
    """Answer the request ``handler`` serves with ``status`` and ``body`` as JSON (no body for ``None``)."""
    data = b"" if body is None else json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _handler(server: RecordingServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            send_json(self, *server.answer(method, self.path, json.loads(raw) if raw else None))

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler
