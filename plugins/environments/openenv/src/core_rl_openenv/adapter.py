"""The worker side of the ``openenv`` plugin: runs in OpenEnv's own venv (never imported by
core-rl; standard library and openenv-core only), served by :mod:`core_rl_server_kit.worker_loop`.

It talks to an OpenEnv environment server with OpenEnv's own client (``GenericEnvClient``: one
WebSocket session per trajectory, actions and observations as dicts). The server is either given
(``url``) or started here: the ``Environment`` class ``environment`` (``module:Class``), served by
openenv-core's own app factory (``create_app``, with ``action`` and ``observation`` its classes and
``max_sessions`` concurrent sessions) under uvicorn on a free local port, in a thread of this worker.

- ``reset(episode, row)``: a session, reset with the row's ``reset_keys`` columns as keyword
  arguments (a seed, a task id); the observation as text;
- ``step(episode, text, turn)``: the action ``{action_field: text}``; ``[observation text, reward
  (None: 0), done, {}]``; an action the server refuses (a validation error) ends the episode with
  reward ``invalid_action_reward`` and ``info["invalid_action"]``;
- ``close(episode)``: the session is closed.

An observation's text is its ``observation_field`` (empty: the observation's fields but
``done``, ``reward`` and ``metadata``, as JSON).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
import time
from typing import Any

#: observation fields that are not its content
NOT_CONTENT = ("done", "reward", "metadata")


def load(target: str) -> Any:
    """``module:Name`` imported."""
    module, _, name = target.partition(":")
    if not name:
        raise ValueError(f"{target!r} is not module:Name")
    return getattr(importlib.import_module(module), name)


def serve_locally(options: dict[str, Any]) -> str:
    """Start the OpenEnv server of ``options["environment"]`` in a thread; its base URL."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    app = create_app(
        load(options["environment"]),
        load(options["action"]),
        load(options["observation"]),
        max_concurrent_envs=options.get("max_sessions", 64),
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, name="openenv-server", daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not threading.main_thread().is_alive():
            raise RuntimeError("the local OpenEnv server did not start within 60 s")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Adapter:
    """See the module docstring."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.base_url = options.get("url") or serve_locally(options)
        self.sessions: dict[str, Any] = {}

    def text(self, observation: Any) -> str:
        field = self.options.get("observation_field", "")
        if not isinstance(observation, dict):
            return str(observation)
        if field:
            if field not in observation:
                raise ValueError(f"the observation has no field {field!r} (it has {sorted(observation)})")
            value = observation[field]
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps({k: v for k, v in observation.items() if k not in NOT_CONTENT})

    async def reset(self, episode: str, row: dict[str, Any]) -> str:
        from openenv import GenericEnvClient

        client = GenericEnvClient(base_url=self.base_url)
        await client.connect()
        self.sessions[episode] = client
        kwargs = {key: row[key] for key in self.options.get("reset_keys", []) if key in row}
        result = await client.reset(**kwargs)
        return self.text(result.observation)

    async def step(self, episode: str, text: str, turn: int) -> list[Any]:
        client = self.sessions.get(episode)
        if client is None:
            raise ValueError(f"no open episode {episode!r} (step before reset, or after the end)")
        try:
            result = await client.step({self.options.get("action_field", "message"): text})
        except RuntimeError as exc:  # the server refused the action (its validation error)
            return ["", float(self.options.get("invalid_action_reward", 0.0)), True, {"invalid_action": str(exc)}]
        return [self.text(result.observation), float(result.reward or 0.0), bool(result.done), {}]

    async def close(self, episode: str) -> None:
        client = self.sessions.pop(episode, None)
        if client is not None:
            await client.disconnect()

    async def shutdown(self) -> None:
        await asyncio.gather(*(self.close(e) for e in list(self.sessions)), return_exceptions=True)


async def open_adapter(options: dict[str, Any]) -> Adapter:
    """The entry point :mod:`core_rl_server_kit.worker_loop` calls (the local server, if any, is
    started off the event loop)."""
    return await asyncio.to_thread(Adapter, options)
