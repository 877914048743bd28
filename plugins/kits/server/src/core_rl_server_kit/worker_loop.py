"""The other side of :mod:`core_rl_server_kit.worker`: the loop a worker process runs in another
interpreter (a library's own venv), where core-rl is not installed. Standard library only.

Run as ``python worker_loop.py ADAPTER_FILE`` with the adapter's options as one JSON line on stdin.
The adapter file defines ``async def open_adapter(options: dict) -> object``; the object it returns
answers requests with its coroutine methods named in :data:`METHODS` (keyword arguments from the
request's ``params``, a JSON-able result). The protocol, one JSON object per line:

- worker -> parent, once: ``{"ready": true}`` after ``open_adapter`` returned, or
  ``{"fatal": "<one line>"}`` (then the worker exits 1);
- parent -> worker: ``{"id": N, "method": M, "params": {...}}``; requests run concurrently;
- worker -> parent: ``{"id": N, "result": ...}`` or ``{"id": N, "error": "<Type>: <message>"}``.

End of stdin (the parent closed the pipe or died) ends the worker, after the adapter's optional
``async def shutdown()``. The protocol owns the original stdout: anything the library prints goes
to stderr instead.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import threading
import traceback
from typing import Any

#: the adapter methods a request may call
METHODS = ("rows", "reset", "step", "close")


def _load_adapter_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("core_rl_worker_adapter", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the adapter file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _Writer:
    """Writes protocol lines on the original stdout, one whole line at a time."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
        os.dup2(2, 1)  # the library's prints (and its children's) go to stderr
        sys.stdout = sys.stderr
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, default=str)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _answer(adapter: Any, request: dict[str, Any], writer: _Writer) -> None:
    ident, method = request.get("id"), request.get("method")
    try:
        if method not in METHODS or not hasattr(adapter, method):
            raise ValueError(f"the adapter has no method {method!r}")
        result = await getattr(adapter, method)(**(request.get("params") or {}))
        writer.send({"id": ident, "result": result})
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        writer.send({"id": ident, "error": _one_line(exc)})


async def _serve(adapter_file: str, options: dict[str, Any], writer: _Writer) -> int:
    try:
        adapter = await _load_adapter_module(adapter_file).open_adapter(options)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        writer.send({"fatal": _one_line(exc)})
        return 1
    writer.send({"ready": True})
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, name="worker-stdin", daemon=True).start()
    running: set[asyncio.Task[None]] = set()
    while (line := await lines.get()) is not None:
        if not line.strip():
            continue
        task = asyncio.create_task(_answer(adapter, json.loads(line), writer))
        running.add(task)
        task.add_done_callback(running.discard)
    for task in list(running):
        task.cancel()
    if hasattr(adapter, "shutdown"):
        await adapter.shutdown()
    return 0


def main() -> int:
    writer = _Writer()
    options = json.loads(sys.stdin.readline() or "{}")
    return asyncio.run(_serve(sys.argv[1], options, writer))


if __name__ == "__main__":
    sys.exit(main())
