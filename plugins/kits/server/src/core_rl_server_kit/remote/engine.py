"""Rollout engines backed by inference servers spoken to over HTTP (the base of ``vllm`` and ``sglang``).

:class:`ServerRolloutEngine` does everything that does not depend on the server's API: it starts
the configured servers (:mod:`core_rl_server_kit.processes`, from the plugin's managed environment, a given
interpreter) or connects to given URLs (checking first that each answers), runs an asyncio loop in
a thread of its own with an ``httpx`` client, generates (:mod:`core_rl_server_kit.remote.generation`: the
least busy server first, a bound on the requests in flight, retries with exponential backoff),
pauses and resumes generation, moves weights by disk or over a process group
(:mod:`core_rl_server_kit.remote.weights`), gives back the servers' GPU memory while the trainer trains
(:mod:`core_rl_server_kit.remote.memory`), and restarts a server that died or stops the run naming it
(:mod:`core_rl_server_kit.remote.recovery`). A subclass supplies the server's command line and its HTTP calls
(the methods marked *plugin* below).

Samples are never lost or duplicated: a request that fails is retried whole (its partial results
are dropped), and a request interrupted by ``pause("abort")`` is continued after ``resume`` from
the tokens it had, its later tokens carrying the newer weight version.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from core_rl.errors import CoreRLError, stderr_line
from core_rl.interfaces import PAUSE_MODES, RolloutEngine, SamplingParams
from core_rl.launch import gpus_per_server, servers_gpus, visible_devices

from core_rl_server_kit.processes import ManagedServer, ServerError, free_port, probe
from core_rl_server_kit.remote.generation import Generation
from core_rl_server_kit.remote.memory import MemoryRelease
from core_rl_server_kit.remote.options import ServerOptions
from core_rl_server_kit.remote.recovery import Endpoint, ServerRecovery
from core_rl_server_kit.remote.weights import UPDATE, WeightSync
from core_rl_server_kit.remote.wire import Completion, async_client

T = TypeVar("T")

#: in every server's environment: a server writes the bytecode of what it imports into its server
#: environment (``core-rl server-env`` builds compile nothing ahead), so only its first start compiles
#: them, even where the trainer's environment sets ``PYTHONDONTWRITEBYTECODE`` (Python reads an empty
#: value as unset; ``server.env`` may set it again)
WRITE_BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}
#: set to ``1`` in a server's environment by a plugin whose server-side launcher then forks the
#: server's engine processes instead of spawning them (the vllm and sglang plugins, on CPU)
FORK_ENGINE = "CORE_RL_FORK_ENGINE"
#: starts of one server on ports core-rl chose, when each lost its port before binding it
PORT_ATTEMPTS = 3


class ServerRolloutEngine(Generation, WeightSync, MemoryRelease, ServerRecovery, RolloutEngine):
    """Base class of rollout engines that generate through inference servers (see the module doc).

    :param model_path: the Hugging Face directory the servers load.
    :param options: the ``server`` subsection.
    :param run_dir: server logs go to ``run_dir/servers/<name>.log``.
    :param sleep: start the servers able to give back their memory (:mod:`core_rl_server_kit.remote.memory`).
    :param trust_remote_code: the servers may run the model directory's own code
        (``actor.trust_remote_code``, :mod:`core_rl.roles.remote_code`): a plugin's :meth:`server_command`
        passes its server's flag for it.
    """

    weight_sync_modes: ClassVar[tuple[str, ...]] = ("disk", "collective")
    #: the server environment (``core_rl_register_server_envs`` name) and the servers' name prefix
    env_name: ClassVar[str] = ""
    health_path: ClassVar[str] = "/health"
    #: *plugin*: True when the plugin's weight update (:meth:`reload_from_disk`,
    #: :meth:`receive_weights`) freezes a server's running requests in place for just the swap
    #: unless :attr:`server_paused`. Then ``pause("keep")`` only holds new requests here: the
    #: running ones go on generating until the update freezes them, on the server, for the swap
    #: alone (one round trip instead of pause, load and resume, and no generation lost to a pause
    #: that waits on the trainer).
    swaps_in_place: ClassVar[bool] = False
    #: whether the servers may run the model's own code (set by ``__init__``)
    trust_remote_code: bool = False

    def __init__(
        self,
        model_path: str | Path,
        options: ServerOptions,
        run_dir: str | Path,
        *,
        sleep: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        self.sleeps = sleep
        self.trust_remote_code = trust_remote_code
        self.model_path = str(model_path)
        self.options = options
        self.run_dir = Path(run_dir)
        self._version = 0
        self._newest_label = 0  # the newest version a weight update labels the servers' tokens with
        self._weights_path: str | None = None  # what a restarted server must load
        self._held: tuple[Any, int] | None = None  # a collective update's weights, until resume()
        self._group: Any = None
        self._group_name = ""  # the current group's (weight_group.new_group_name: a new one each time)
        self._group_members: list[int] = []
        self._fatal: ServerError | None = None  # the error the engine stopped with
        self._paused_mode: str | None = None
        self.server_paused = False  # whether pause() paused the servers themselves
        self.last_sync: dict[str, float] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{self.env_name}-rollout", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._call(self._setup(), 60, "the HTTP client to start")
            self.endpoints = self._start_endpoints()
            self._call(self._attach_locks(), 60, "the engine's locks")
        except BaseException:
            self.close()
            raise

    # -- plugin hooks ---------------------------------------------------------------------------

    @abstractmethod
    def server_command(self, python: str, port: int, index: int) -> list[str]:
        """*plugin*: the command line of server ``index`` listening on ``port``."""

    def check_model(self) -> None:
        """*plugin*: raise :class:`~core_rl.errors.CoreRLError` when the servers core-rl would
        start cannot serve ``model_path`` (known limits of the server on this device), before any
        server starts."""

    def server_environment(self, index: int) -> dict[str, str]:
        """*plugin*: environment variables server ``index`` needs (added to ``options.env``)."""
        return {}

    def workers_per_server(self) -> int:
        """*plugin*: how many worker processes of one server join the weight-update group."""
        return 1

    def variant(self) -> str:
        """The servers' device variant: ``server.env_variant``, else this machine's
        (:func:`core_rl_server_kit.env.default_variant`)."""
        from core_rl_server_kit.env import default_variant

        return self.options.env_variant or default_variant()

    @abstractmethod
    async def request(self, client: Any, url: str, prompt_ids: list[int], sampling: SamplingParams) -> list[Completion]:
        """*plugin*: one HTTP request for the ``sampling.n`` samples of ``prompt_ids``. A plugin whose
        config class claims ``multimodal`` also takes a ``media`` keyword: the prompt's pixel
        inputs (:attr:`core_rl.protocol.Sample.media`), passed only for a prompt that has them."""

    #: *plugin*: True when :meth:`request_batch` sends several requests in one HTTP round trip
    batches_requests: ClassVar[bool] = False

    async def request_batch(
        self,
        client: Any,
        url: str,
        items: Sequence[tuple[list[int], SamplingParams]],
        deliver: Callable[[int, list[Completion] | BaseException], None],
    ) -> None:
        """*plugin*: send ``items`` (prompt, sampling) to one server and call ``deliver(i,
        completions)`` (or ``deliver(i, error)``) for each as it finishes. An exception raised here
        is every undelivered item's error. This default sends one :meth:`request` each, side by
        side; a plugin whose server takes several in one HTTP round trip overrides it and sets
        :attr:`batches_requests`, so that requests are gathered for it."""

        async def one(index: int, prompt_ids: list[int], sampling: SamplingParams) -> None:
            try:
                completions = await self.request(client, url, prompt_ids, sampling)
            except Exception as exc:
                deliver(index, exc)
            else:
                deliver(index, completions)

        await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(items)))

    @abstractmethod
    async def pause_server(self, client: Any, url: str, mode: str) -> None:
        """*plugin*: pause generation on one server (``keep`` or ``abort``)."""

    @abstractmethod
    async def resume_server(self, client: Any, url: str) -> None:
        """*plugin*: resume generation on one server."""

    @abstractmethod
    async def abort_all(self, client: Any, url: str) -> None:
        """*plugin*: abort every request one server holds (they return what they generated)."""

    @abstractmethod
    async def reload_from_disk(self, client: Any, url: str, path: str, version: int) -> None:
        """*plugin*: load the Hugging Face directory ``path`` into one server (and drop its cache)."""

    @abstractmethod
    async def join_weight_group(
        self, client: Any, url: str, *, address: str, port: int, rank_offset: int, world_size: int, backend: str
    ) -> None:
        """*plugin*: make one server's workers join the weight-update group (ranks from
        ``rank_offset``); returns once they joined (the trainer joins concurrently)."""

    @abstractmethod
    async def receive_weights(
        self, client: Any, url: str, *, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int
    ) -> None:
        """*plugin*: make one server receive the broadcast tensors (in this order) and load them;
        returns once loaded (the trainer broadcasts concurrently)."""

    # -- the loop thread ------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, what: str = "") -> T:
        """Run ``coro`` on the engine's loop and wait for it (from any other thread); ``what`` it
        waits for names it in the error after ``timeout`` seconds. Raises the error the engine
        stopped with, if any."""
        if self._fatal is not None:
            coro.close()
            raise self._fatal
        if self._closed:
            coro.close()
            raise CoreRLError(f"the {self.env_name} rollout engine is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise ServerError(
                f"{self.env_name} rollout engine: waited {timeout:.0f} s for {what or 'an operation'}"
            ) from None

    async def _setup(self) -> None:
        self._client = async_client(self.options.request_timeout, self.options.max_concurrent_requests + 16)
        self._running = asyncio.Event()
        self._running.set()
        self._slots = asyncio.Semaphore(self.options.max_concurrent_requests)
        self._idle = asyncio.Condition()
        self._inflight = 0
        self._batches: dict[str, list[tuple[list[int], SamplingParams, asyncio.Future]]] = {}
        self._flushes: set[asyncio.Task] = set()

    async def _attach_locks(self) -> None:
        for ep in self.endpoints:
            ep.lock = asyncio.Lock()

    # -- servers --------------------------------------------------------------------------------

    def server_python(self) -> str:
        """The interpreter servers start with: ``options.python`` or the managed environment's."""
        if self.options.python:
            return self.options.python
        from core_rl_server_kit import env as server_env

        spec = server_env.get_spec(self.env_name)
        variant = self.options.env_variant or None
        found = server_env.find(spec, variant=variant)
        if found is None:
            if not self.options.create_env:
                raise CoreRLError(
                    f"the {self.env_name} server environment is not built; run: core-rl server-env create "
                    f"{self.env_name} (or set rollout.engine.server.python or server.urls)"
                )
            found = server_env.create(spec, variant=variant, echo=lambda m: print(m, flush=True))
        return str(server_env.env_python(found))

    def _connect(self, urls: Sequence[str]) -> list[Endpoint]:
        """Endpoints for servers already running at ``urls``; each must answer its health check."""
        for i, url in enumerate(urls):
            problem = probe(url.rstrip("/") + self.health_path, timeout=10.0)
            if problem is not None:
                raise CoreRLError(
                    f"rollout.engine.server.urls[{i}]: no {self.env_name} server answers at {url} "
                    f"(GET {self.health_path}: {problem}). Start the server first or correct the URL; with "
                    "server.urls empty, core-rl starts its own servers"
                )
        return [Endpoint(name=f"{self.env_name}@{url}", url=url.rstrip("/")) for url in urls]

    def _start_endpoints(self) -> list[Endpoint]:
        opts = self.options
        if opts.urls:
            return self._connect(opts.urls)
        if opts.ports and len(opts.ports) != opts.num_servers:
            raise CoreRLError(
                f"rollout.engine.server.ports lists {len(opts.ports)} ports for num_servers={opts.num_servers}"
            )
        self.check_model()
        python = self.server_python()
        devices = self._servers_devices()
        endpoints = []
        for i in range(opts.num_servers):
            server = self._managed_server(i, python, devices[i], opts.ports[i] if opts.ports else free_port(opts.host))
            endpoints.append(Endpoint(name=server.name, url=server.url, server=server))
        try:
            for ep in endpoints:
                assert ep.server is not None
                ep.server.start()
            deadline = time.monotonic() + opts.startup_timeout
            for i, ep in enumerate(endpoints):
                self._wait_started(ep, i, python, devices[i], deadline)
        except BaseException:
            for ep in endpoints:
                if ep.server is not None:
                    ep.server.stop()
            raise
        return endpoints

    def _managed_server(self, index: int, python: str, devices: dict[str, str], port: int) -> ManagedServer:
        opts = self.options
        name = f"{self.env_name}-{index}"
        return ManagedServer(
            name,
            self.server_command(python, port, index),
            host=opts.host,
            port=port,
            log_path=self.run_dir / "servers" / f"{name}.log",
            env={**WRITE_BYTECODE, **self.server_environment(index), **devices, **opts.env},
            health_path=self.health_path,
            grace=opts.shutdown_grace,
            cpus=opts.cpus,
        )

    def _wait_started(self, ep: Endpoint, index: int, python: str, devices: dict[str, str], deadline: float) -> None:
        """Wait for ``ep``'s server to become healthy (until ``deadline``, the servers' common
        ``startup_timeout``). A server on a port core-rl chose that lost the port to another
        process before binding it is started again on another port, up to :data:`PORT_ATTEMPTS`
        times, each new start with a whole ``startup_timeout`` of its own (a server may notice
        the lost port only after loading its model)."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            assert ep.server is not None
            try:
                ep.server.wait_healthy(max(1.0, deadline - time.monotonic()))
                return
            except ServerError:
                if self.options.ports or attempt == PORT_ATTEMPTS or not ep.server.lost_its_port():
                    raise
            taken = ep.server.port
            ep.server.stop()
            ep.server = self._managed_server(index, python, devices, free_port(self.options.host))
            ep.url = ep.server.url
            stderr_line(
                f"core-rl: server {ep.name}: port {taken} was taken by another process before the server bound it; "
                f"starting it again on port {ep.server.port}"
            )
            ep.server.start()
            deadline = time.monotonic() + self.options.startup_timeout

    def _servers_devices(self) -> list[dict[str, str]]:
        """Each started server's ``CUDA_VISIBLE_DEVICES`` from ``server.gpus`` (none when empty)."""
        opts = self.options
        if not opts.gpus:
            return [{} for _ in range(opts.num_servers)]
        if "CUDA_VISIBLE_DEVICES" in opts.env:
            raise CoreRLError(
                "rollout.engine.server.gpus and rollout.engine.server.env.CUDA_VISIBLE_DEVICES both choose the "
                "servers' GPUs; keep one"
            )
        shares = servers_gpus(opts.gpus, opts.num_servers, gpus_per_server(getattr(self, "config", None)))
        return [{"CUDA_VISIBLE_DEVICES": visible_devices(share)} for share in shares]

    def health(self) -> dict[str, bool]:
        from core_rl_server_kit.processes import check_health

        return {ep.name: check_health(ep.url + self.health_path, timeout=5.0) for ep in self.endpoints}

    def server_logs(self) -> dict[str, Path]:
        """The current log file of each managed server, by name (a restarted server has a new one)."""
        return {ep.name: ep.server.log_path for ep in self.endpoints if ep.server is not None}

    # -- pause and resume -----------------------------------------------------------------------

    async def _apause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if self._paused_mode is not None:
            return
        self._running.clear()
        self._paused_mode = mode
        if mode == "wait":
            async with self._idle:
                await self._idle.wait_for(lambda: self._inflight == 0)
        elif mode == "keep" and self.swaps_in_place:
            return  # the weight update freezes the running requests for the swap (swaps_in_place)
        else:
            self.server_paused = True  # before: a server that paused is resumed even if another failed
            await self._each_server(lambda ep: self.pause_server(self._client, ep.url, mode), f"pause ({mode})")
            if mode == "abort":  # the interrupted requests return; their continuations wait
                await self._abort_until_idle()

    async def _abort_until_idle(self) -> None:
        """Abort until no request is in flight: a request that reached a server just after it
        paused is held there, not aborted, so abort again until every request has returned
        (after 0.05 s, then twice as long each time up to 1 s: a weight update waits on this)."""
        wait = 0.05
        while True:
            async with self._idle:
                try:
                    await asyncio.wait_for(self._idle.wait_for(lambda: self._inflight == 0), wait)
                    return
                except TimeoutError:
                    pass
            await self._each_server(lambda ep: self.abort_all(self._client, ep.url), "abort its requests")
            wait = min(2 * wait, 1.0)

    async def _each_server(self, call: Callable[[Endpoint], Coroutine[Any, Any, None]], what: str) -> None:
        """``call(ep)`` for every server side by side; a server that died meanwhile is restarted
        (as recovery allows) and called again."""

        async def one(ep: Endpoint) -> None:
            while True:
                generation = ep.generation
                try:
                    await call(ep)
                    return
                except Exception as exc:
                    if not await self._recover(ep, generation, exc, during=UPDATE if self._paused_mode else "idle"):
                        raise self._call_failed(ep, what, exc) from None

        await asyncio.gather(*(one(ep) for ep in self.endpoints))

    async def _resume_servers(self) -> None:
        if self.server_paused:
            await self._each_server(lambda ep: self.resume_server(self._client, ep.url), "resume")
            self.server_paused = False

    async def _admit(self) -> None:
        self._paused_mode = None
        self._running.set()

    def pause(self, mode: str = "wait") -> None:
        self._call(self._apause(mode), self.options.request_timeout, f"generation to pause ({mode})")

    def resume(self) -> None:
        """Resume the servers (restarting one that died, as recovery allows), send a collective
        update's weights again to a server restarted since, then admit requests."""
        try:
            self._call(self._resume_servers(), self.options.request_timeout, "the servers to resume")
            self._resend_after_restart()
            self._call(self._admit(), 60, "requests to be admitted again")
        finally:
            self._held = None

    @property
    def paused(self) -> bool:
        return self._paused_mode is not None

    # -- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the requests in flight, the servers core-rl started (and their children), the HTTP
        client and the loop."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            try:  # requests still retrying end here, not after the loop stopped
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(10)
                if getattr(self, "_client", None) is not None:
                    asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(10)
            except Exception:
                pass
        if self._group is not None:
            from core_rl_server_kit import weight_group

            weight_group.destroy_group(self._group)
            self._group = None
        for ep in getattr(self, "endpoints", []):
            if ep.server is not None:
                ep.server.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def _cancel_tasks() -> None:
    """Cancel every other task of the running loop and let them finish."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
