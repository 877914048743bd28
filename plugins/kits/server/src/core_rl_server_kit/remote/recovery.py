"""What a server-backed rollout engine does when one of the servers it started dies.

A call to a server that fails (a request, a pause, a weight update, a resume) asks
:meth:`ServerRecovery._recover` whether the server is gone: its process exited, or it answers
its health check with an error and does not exit within :data:`UNHEALTHY_EXIT_S` (a server whose
engine died). If it is, the engine either restarts it and repeats the call, or stops with a
:class:`~core_rl_server_kit.processes.ServerError` (exit status 1) naming the server, what it was doing, how it
ended, its log and the log's last error line:

- ``on_server_failure: fail``: never restarted;
- a server that fails by itself (it exits, not killed by a signal, or fails its health check)
  before it answered any request crashed on its first request: not restarted, because a restart
  would crash the same way (a model the server cannot run, say);
- a server restarted ``max_restarts`` times already: not restarted again ("max_restarts reached");
- weights: a restarted server starts from the model directory (version 0). With
  ``weight_sync: disk`` it then loads the newest weights directory, and it is back at once. With
  ``weight_sync: collective`` the weights exist only in the trainer: inside a weight update
  (between ``pause`` and ``resume``) the engine forms a new weight-update group with every server,
  the restarted one included, and broadcasts the update's weights again; outside one (a server
  that dies while generating) the restarted server takes no requests until the next weight update
  reaches it, while the other servers carry on; with no other server holding the newest weights the
  run stops.

A server that died after it served (all but the first-request crash) ends the run with a
``recoverable`` error: ``recover.mode: auto`` resumes the run from its newest checkpoint with new
servers. Each start of a server writes a log of its own: ``<name>.log``, then
``<name>.restart1.log``, ... The error the engine stops with is kept: every later call of the
engine raises it again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from core_rl_server_kit.processes import ManagedServer, ServerError, probe
from core_rl_server_kit.remote.wire import describe, is_transport_error

#: seconds a server that fails its health check is given to exit by itself before it counts as dead
UNHEALTHY_EXIT_S = 30.0

if TYPE_CHECKING:
    from core_rl_server_kit.remote.options import ServerOptions


@attrs.define(eq=False)
class Endpoint:
    """One server as the engine sees it. ``version``: the weight version the server holds (a
    server that has not the engine's newest gets no requests); ``served``: whether it answered a
    request since it last started."""

    name: str
    url: str
    server: ManagedServer | None = None
    inflight: int = 0
    restarts: int = 0
    generation: int = 0  # bumped by each restart
    version: int = 0
    served: bool = False
    lock: asyncio.Lock | None = None
    #: the memory parts the server gave back (:mod:`core_rl_server_kit.remote.memory`); a restart wakes it
    asleep: tuple[str, ...] = ()

    def alive(self) -> bool:
        """Whether the server runs (a server given by URL is assumed to)."""
        return self.server is None or self.server.alive()


def restart_log(first: Path, restart: int) -> Path:
    """The log of the ``restart``-th restart of the server whose first log is ``first``
    (``vllm-0.log`` -> ``vllm-0.restart1.log``)."""
    return first.with_name(f"{first.stem}.restart{restart}{first.suffix}")


class ServerRecovery:
    """Mixin of :class:`~core_rl_server_kit.remote.ServerRolloutEngine`: dead servers (see the module doc)."""

    env_name: str
    health_path: str
    options: ServerOptions
    endpoints: list[Endpoint]
    _client: Any
    _version: int
    _weights_path: str | None
    _held: tuple[Any, int] | None
    _paused_mode: str | None
    server_paused: bool
    _fatal: ServerError | None

    if TYPE_CHECKING:  # plugin hooks of ServerRolloutEngine

        async def reload_from_disk(self, client: Any, url: str, path: str, version: int) -> None: ...

        async def pause_server(self, client: Any, url: str, mode: str) -> None: ...

    def _stop(self, error: ServerError) -> ServerError:
        """Keep ``error`` as the engine's final one (later calls raise it again) and return it."""
        if self._fatal is None:
            self._fatal = error
        return self._fatal

    def _current(self, ep: Endpoint) -> bool:
        """Whether ``ep`` holds the engine's newest weights."""
        return ep.version == self._version

    async def _recover(
        self, ep: Endpoint, generation: int, exc: BaseException | None, *, during: str, reload: bool = True
    ) -> bool:
        """After a call to ``ep`` failed with ``exc``: whether its managed server had died and is
        running again (restarted here, or by another caller since the call began: the caller
        repeats its call). ``False``: the server runs (or was given by URL), the failure is the
        call's own. Raises :class:`ServerError` where it died and is not restarted. ``during``
        says what it was doing ("while generating", "during a weight update"); ``reload``: load
        the newest weights directory (``weight_sync: disk``) into a restarted server."""
        if ep.server is None:
            return False
        if ep.generation != generation:
            return True
        if ep.server.alive():
            problem = await asyncio.to_thread(probe, ep.url + self.health_path, 5.0)
            if problem is None or problem.startswith("no answer"):
                return False  # it runs (or is too busy to answer its health check)
            # it answers errors and fails its health check: a server whose engine died shuts down
            await asyncio.to_thread(ep.server.wait_exit, UNHEALTHY_EXIT_S)
        # (waits for the supervisor to report how the server ended: a kill, or an exit of its own)
        failed_itself = not (await asyncio.to_thread(ep.server.end_state)).startswith("killed")
        assert ep.lock is not None
        async with ep.lock:
            if ep.generation != generation:  # another call restarted it meanwhile
                return True
            self._may_restart(ep, exc, during, failed_itself=failed_itself)
            await self._restart(ep, reload=reload)
            return True

    def _may_restart(self, ep: Endpoint, exc: BaseException | None, during: str, *, failed_itself: bool) -> None:
        """Raise the :class:`ServerError` that stops the run if the dead server ``ep`` may not be
        restarted (the rules of the module doc); ``failed_itself``: it was not killed by a signal
        (it exited, or still runs failing its health check)."""
        server = ep.server
        assert server is not None
        why = f" ({describe(exc)})" if exc is not None else ""
        opts = self.options
        if not ep.served and failed_itself:
            raise self._stop(
                server.failure(
                    f"crashed on its first request {during}{why}; it is not restarted: a restarted server "
                    "would crash the same way"
                )
            )
        if opts.on_server_failure == "fail":
            raise self._stop(
                server.failure(f"died {during}{why} (rollout.engine.server.on_server_failure: fail)", recoverable=True)
            )
        if ep.restarts >= opts.max_restarts:
            raise self._stop(
                server.failure(
                    f"died {during}{why}; restarted {ep.restarts} times already: rollout.engine.server.max_restarts "
                    f"({opts.max_restarts}) reached",
                    recoverable=True,
                )
            )
        if self._weights_path is None and self._version > 0 and self._held is None:
            others = [e for e in self.endpoints if e is not ep and self._current(e) and e.alive()]
            if not others:
                raise self._stop(
                    server.failure(
                        f"died {during}{why}; a restarted server cannot get back the weights of version "
                        f"{self._version}: they came over a collective, which only a weight update sends, and no "
                        "other server holds them (weight_sync: disk restarts a server at any time; recover.mode: auto "
                        "resumes the run from its newest checkpoint)",
                        recoverable=True,
                    )
                )

    async def _restart(self, ep: Endpoint, *, reload: bool) -> None:
        """Start ``ep``'s dead server again, with a log of its own; give it the newest weights
        directory when ``reload`` (``weight_sync: disk``); pause it if the others are paused.
        A restarted server is not in the weight-update group: the next collective update forms a
        new one."""
        server = ep.server
        assert server is not None
        old_log = server.log_path
        state = await asyncio.to_thread(server.end_state)
        ep.restarts += 1
        new_log = restart_log(server.first_log_path, ep.restarts)
        print(
            f"core-rl: server {ep.name} {'failed its health check' if state == 'still running' else state}; "
            f"restarting it (restart {ep.restarts} of max_restarts {self.options.max_restarts}); its log so far: "
            f"{old_log}, the new one: {new_log}",
            flush=True,
        )
        await asyncio.to_thread(server.stop)
        server.start(log_path=new_log)  # from the loop thread, which lives as long as the engine
        ep.generation += 1
        ep.version, ep.served, ep.asleep = 0, False, ()
        await asyncio.to_thread(server.wait_healthy, self.options.startup_timeout)
        if reload and self._weights_path is not None:
            await self.reload_from_disk(self._client, ep.url, self._weights_path, self._version)
            ep.version = self._version
        if self.server_paused and self._paused_mode is not None:
            await self.pause_server(self._client, ep.url, self._paused_mode)

    def _call_failed(self, ep: Endpoint, what: str, exc: BaseException) -> BaseException:
        """The error to raise when ``what`` (e.g. "load the weights of version 3") failed on the
        running server ``ep`` with ``exc``: a server's answer as it is, a transport failure as a
        :class:`ServerError` naming the server."""
        if isinstance(exc, ServerError) or not (is_transport_error(exc) or isinstance(exc, (OSError, TimeoutError))):
            return exc
        if ep.server is not None:
            return ep.server.failure(f"did not {what}: {describe(exc)}")
        return ServerError(f"server {ep.name} did not {what}: {describe(exc)}")
