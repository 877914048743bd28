"""Rollout engines backed by inference servers spoken to over HTTP (the base of ``vllm`` and ``sglang``).

:class:`ServerRolloutEngine` does everything that does not depend on the server's API: it starts
the configured servers (:mod:`core_rl.servers`, from the plugin's managed environment, a given
interpreter) or connects to given URLs, runs an asyncio loop in a thread of its own with an
``httpx`` client, spreads requests over the servers (the least busy first) under a bound on the
requests in flight, retries failed requests with exponential backoff, detects a server that died
(naming it and quoting its log) and restarts it or fails as configured, pauses and resumes
generation, and moves weights by disk or over a process group. A subclass supplies the server's
command line and its HTTP calls (the methods marked *plugin* below).

Requests for one server that arrive together (a generation batch starting) go out in one HTTP
round trip where the plugin supports it (:meth:`ServerRolloutEngine.request_batch`); each keeps its
own retries, timeout and answer.

Samples are never lost or duplicated: a request that fails is retried whole (its partial results
are dropped), and a request interrupted by ``pause("abort")`` is continued after ``resume`` from
the tokens it had, its later tokens carrying the newer weight version.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import attrs

from core_rl.config.validators import FieldValueError, non_negative, one_of, positive
from core_rl.errors import CoreRLError
from core_rl.interfaces import PAUSE_MODES, RolloutEngine, SamplingParams
from core_rl.protocol import Sample
from core_rl.servers import ManagedServer, ServerError, free_port

T = TypeVar("T")


@attrs.define
class ServerOptions:
    """The ``server`` subsection of a server-backed rollout engine: where servers come from and how
    requests to them behave.

    - ``urls``: base URLs of servers already running; core-rl neither starts nor stops them.
      Empty: core-rl starts ``num_servers`` servers on ``host`` at ``ports`` (free ports if empty).
    - ``python``: the interpreter to start servers with; empty: the plugin's managed server
      environment (``core-rl server-env create NAME``; built on first use when
      ``create_env`` is true), of ``env_variant`` (``cpu``/``cuda``; empty: ``cuda`` where
      ``nvidia-smi`` exists).
    - ``env``: environment variables for the servers.
    - ``cpus``: CPU cores the started servers run on (their processes' affinity; empty: any). Where
      rollout and training share a machine's CPUs, giving each side its own cores keeps one
      side's threads (and an inference engine's busy-polling scheduler) off the other's.
    - ``startup_timeout``: seconds a server may take to answer its health check.
    - ``request_timeout``, ``max_retries``, ``retry_backoff``: each request may take
      ``request_timeout`` s; a failed one is retried up to ``max_retries`` times, after
      ``retry_backoff * 2**k`` s.
    - ``max_concurrent_requests``: requests in flight over all servers (each asks for the ``n``
      samples of one prompt).
    - ``batch_window_s``: requests for one server that arrive within this many seconds of the
      first go to it in one HTTP round trip, where the plugin can send several at once (each is
      still its own request on the server and comes back as soon as it finishes); 0: one HTTP
      request each.
    - ``on_server_failure``: ``restart`` a managed server that died (at most ``max_restarts``
      times each) or ``fail`` the run with its name and log.
    - ``update_pause_mode``: how generation pauses around a weight update when the caller has not
      paused it already (``wait``, ``keep`` or ``abort``, see :meth:`RolloutEngine.pause`).
    - ``weight_sync_backend``: ``auto`` (``nccl`` for the ``cuda`` variant, else ``gloo``),
      ``gloo`` or ``nccl``; ``weight_sync_timeout``: seconds a weight update may take;
      ``weight_sync_address``: the trainer's address as the servers reach it (empty: ``host``
      for started servers, 127.0.0.1 for ``urls``).
    """

    urls: list[str] = attrs.field(factory=list)
    python: str = ""
    create_env: bool = True
    env_variant: str = attrs.field(default="", validator=one_of(("", "cpu", "cuda")))
    num_servers: int = attrs.field(default=1, validator=positive())
    host: str = "127.0.0.1"
    ports: list[int] = attrs.field(factory=list)
    env: dict[str, str] = attrs.field(factory=dict)
    cpus: list[int] = attrs.field(factory=list, validator=lambda _i, a, v: _check_cpus(a.name, v))
    startup_timeout: float = attrs.field(default=600.0, validator=positive())
    shutdown_grace: float = attrs.field(default=15.0, validator=positive())
    request_timeout: float = attrs.field(default=600.0, validator=positive())
    max_retries: int = attrs.field(default=3, validator=non_negative())
    retry_backoff: float = attrs.field(default=1.0, validator=non_negative())
    max_concurrent_requests: int = attrs.field(default=64, validator=positive())
    batch_window_s: float = attrs.field(default=0.002, validator=non_negative())
    on_server_failure: str = attrs.field(default="restart", validator=one_of(("restart", "fail")))
    max_restarts: int = attrs.field(default=2, validator=non_negative())
    update_pause_mode: str = attrs.field(default="wait", validator=one_of(PAUSE_MODES))
    weight_sync_backend: str = attrs.field(default="auto", validator=one_of(("auto", "gloo", "nccl")))
    weight_sync_address: str = ""
    weight_sync_timeout: float = attrs.field(default=600.0, validator=positive())


def _check_cpus(name: str, cpus: list[int]) -> None:
    """Every core of ``cpus`` must exist on this machine (``0 .. os.cpu_count() - 1``)."""
    import os

    count = os.cpu_count() or 1
    missing = [c for c in cpus if not 0 <= c < count]
    if missing:
        raise FieldValueError(name, cpus, f"cores {missing} do not exist here (cores 0 to {count - 1})")


@attrs.define
class Completion:
    """One sample as a server returned it; ``finish_reason`` is ``stop``, ``length`` or ``abort``
    (interrupted by a pause). ``versions``: the weight version that generated each token, where
    the server reports it (a weight update that keeps running requests in place changes it
    mid-sample); ``None``: every token has the version the request started under."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int] | None = None


class ServerReplyError(CoreRLError):
    """A server answered, but not as expected (an error status or a malformed body).

    ``status`` is the HTTP status (0 for a malformed body). A 4xx other than 408 and 429 means the
    request itself is wrong: it is not retried."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        return not (400 <= self.status < 500 and self.status not in (408, 429))


@attrs.define(eq=False)
class Endpoint:
    """One server as the engine sees it."""

    name: str
    url: str
    server: ManagedServer | None = None
    inflight: int = 0
    restarts: int = 0
    generation: int = 0  # bumped by each restart
    lock: asyncio.Lock | None = None


class ServerRolloutEngine(RolloutEngine):
    """Base class of rollout engines that generate through inference servers (see the module doc).

    :param model_path: the Hugging Face directory the servers load.
    :param options: the ``server`` subsection.
    :param run_dir: server logs go to ``run_dir/servers/<name>.log``.
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

    def __init__(self, model_path: str | Path, options: ServerOptions, run_dir: str | Path) -> None:
        self.model_path = str(model_path)
        self.options = options
        self.run_dir = Path(run_dir)
        self._version = 0
        self._newest_label = 0  # the newest version a weight update labels the servers' tokens with
        self._weights_path: str | None = None  # what a restarted server must load
        self._group: Any = None
        self._group_epoch = 0  # a new group (and name) after a server restart
        self._paused_mode: str | None = None
        self.server_paused = False  # whether pause() paused the servers themselves
        self.last_sync: dict[str, float] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{self.env_name}-rollout", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._call(self._setup(), timeout=60)
            self.endpoints = self._start_endpoints()
            self._call(self._attach_locks(), timeout=60)
        except BaseException:
            self.close()
            raise

    @property
    def _group_name(self) -> str:
        return f"core_rl_weights_{id(self):x}_{self._group_epoch}"

    # -- plugin hooks ---------------------------------------------------------------------------

    @abstractmethod
    def server_command(self, python: str, port: int, index: int) -> list[str]:
        """*plugin*: the command line of server ``index`` listening on ``port``."""

    def server_environment(self, index: int) -> dict[str, str]:
        """*plugin*: environment variables server ``index`` needs (added to ``options.env``)."""
        return {}

    def workers_per_server(self) -> int:
        """*plugin*: how many worker processes of one server join the weight-update group."""
        return 1

    @abstractmethod
    async def request(self, client: Any, url: str, prompt_ids: list[int], sampling: SamplingParams) -> list[Completion]:
        """*plugin*: one HTTP request for the ``sampling.n`` samples of ``prompt_ids``."""

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

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the engine's loop and wait for it (from any other thread)."""
        if self._closed:
            coro.close()
            raise CoreRLError(f"the {self.env_name} rollout engine is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise CoreRLError(
                f"{self.env_name} rollout engine: an operation took longer than {timeout:.0f} s"
            ) from None

    async def _setup(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=self.options.max_concurrent_requests + 16)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.options.request_timeout), limits=limits)
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
        from core_rl import server_env

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

    def _start_endpoints(self) -> list[Endpoint]:
        opts = self.options
        if opts.urls:
            return [Endpoint(name=f"{self.env_name}@{url}", url=url.rstrip("/")) for url in opts.urls]
        if opts.ports and len(opts.ports) != opts.num_servers:
            raise CoreRLError(
                f"rollout.engine.server.ports lists {len(opts.ports)} ports for num_servers={opts.num_servers}"
            )
        python = self.server_python()
        endpoints = []
        for i in range(opts.num_servers):
            port = opts.ports[i] if opts.ports else free_port(opts.host)
            name = f"{self.env_name}-{i}"
            server = ManagedServer(
                name,
                self.server_command(python, port, i),
                host=opts.host,
                port=port,
                log_path=self.run_dir / "servers" / f"{name}.log",
                env={**self.server_environment(i), **opts.env},
                health_path=self.health_path,
                grace=opts.shutdown_grace,
                cpus=opts.cpus,
            )
            endpoints.append(Endpoint(name=name, url=server.url, server=server))
        try:
            for ep in endpoints:
                assert ep.server is not None
                ep.server.start()
            deadline = time.monotonic() + opts.startup_timeout
            for ep in endpoints:
                assert ep.server is not None
                ep.server.wait_healthy(max(1.0, deadline - time.monotonic()))
        except BaseException:
            for ep in endpoints:
                if ep.server is not None:
                    ep.server.stop()
            raise
        return endpoints

    def health(self) -> dict[str, bool]:
        from core_rl.servers import check_health

        return {ep.name: check_health(ep.url + self.health_path, timeout=5.0) for ep in self.endpoints}

    def server_logs(self) -> dict[str, Path]:
        """Log file of each managed server, by name."""
        return {ep.name: ep.server.log_path for ep in self.endpoints if ep.server is not None}

    async def _handle_failure(self, ep: Endpoint, generation: int, exc: BaseException) -> None:
        """After a failed request to ``ep``: if its managed server died, restart it (or raise a
        :class:`ServerError` naming it, as configured); otherwise let the caller retry."""
        if ep.server is None or ep.server.alive():
            return
        assert ep.lock is not None
        async with ep.lock:
            if ep.generation != generation:  # another request restarted it already
                return
            if self.options.on_server_failure == "fail" or ep.restarts >= self.options.max_restarts:
                raise ep.server.failure(f"died during rollout ({type(exc).__name__}: {exc})") from None
            if self._version > 0 and self._weights_path is None:
                raise ep.server.failure(
                    f"died during rollout; it cannot be restarted with the weights of version {self._version}, "
                    "which came over a collective (use weight_sync=disk to allow restarts)"
                ) from None
            print(f"core-rl: server {ep.name} died; restarting it (log {ep.server.log_path})", flush=True)
            await asyncio.to_thread(ep.server.stop)
            ep.server.start()  # from the loop thread, which lives as long as the engine
            await asyncio.to_thread(ep.server.wait_healthy, self.options.startup_timeout)
            if self._weights_path is not None:
                await self.reload_from_disk(self._client, ep.url, self._weights_path, self._version)
            if self._group is not None:  # the restarted server is not in it: form a new one next time
                from core_rl import weight_group

                weight_group.destroy_group(self._group)
                self._group, self._group_epoch = None, self._group_epoch + 1
            ep.restarts += 1
            ep.generation += 1

    def _pick(self) -> Endpoint:
        return min(self.endpoints, key=lambda ep: ep.inflight)

    # -- generation -----------------------------------------------------------------------------

    async def _request_with_retries(
        self, prompt_ids: list[int], sampling: SamplingParams
    ) -> tuple[list[Completion], int]:
        """The completions of one request and the weight version it started under."""
        last: BaseException | None = None
        ep: Endpoint | None = None
        for attempt in range(self.options.max_retries + 1):
            await self._running.wait()
            async with self._slots:
                await self._running.wait()
                ep = self._pick()
                generation, version = ep.generation, self._version
                ep.inflight += 1
                self._inflight += 1
                try:
                    completions = await asyncio.wait_for(
                        self._send(ep.url, prompt_ids, sampling), self.options.request_timeout
                    )
                    if len(completions) != sampling.n:
                        raise ServerReplyError(f"{ep.name} returned {len(completions)} samples, asked for {sampling.n}")
                    return completions, version
                except ServerReplyError as exc:
                    if not exc.retryable:
                        raise
                    last = exc
                except (TimeoutError, OSError) as exc:
                    last = exc
                except Exception as exc:
                    if not _is_http_error(exc):
                        raise
                    last = exc
                finally:
                    ep.inflight -= 1
                    self._inflight -= 1
                    async with self._idle:
                        self._idle.notify_all()
            await self._handle_failure(ep, generation, last)
            if attempt < self.options.max_retries:
                await asyncio.sleep(self.options.retry_backoff * 2**attempt)
        assert ep is not None
        what = f"a request failed {self.options.max_retries + 1} times; last error: {type(last).__name__}: {last}"
        if ep.server is not None:
            raise ep.server.failure(what)
        raise ServerError(f"server {ep.name}: {what}")

    def _send(self, url: str, prompt_ids: list[int], sampling: SamplingParams) -> Awaitable[list[Completion]]:
        """The completions of one request to ``url``: its own HTTP request, or a place in the batch
        that leaves for ``url`` ``batch_window_s`` after its first request (see the module doc)."""
        window = self.options.batch_window_s
        if window <= 0 or not self.batches_requests:
            return self.request(self._client, url, prompt_ids, sampling)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        batch = self._batches.setdefault(url, [])
        batch.append((prompt_ids, sampling, future))
        if len(batch) == 1:
            loop.call_later(window, self._start_flush, url)
        return future

    def _start_flush(self, url: str) -> None:
        task = self._loop.create_task(self._flush(url))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self, url: str) -> None:
        """Send the batch gathered for ``url``; settle each waiting request with its answer."""
        batch = self._batches.pop(url, [])
        futures = [future for _, _, future in batch]

        def deliver(index: int, result: list[Completion] | BaseException) -> None:
            if not 0 <= index < len(futures):
                raise ServerReplyError(f"{url} answered request {index} of a batch of {len(futures)}")
            future = futures[index]
            if future.done():  # its caller gave up (timeout) or it was answered already
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        try:
            await self.request_batch(self._client, url, [(p, s) for p, s, _ in batch], deliver)
        except Exception as exc:
            for i in range(len(futures)):
                deliver(i, exc)
        else:
            for i in range(len(futures)):
                deliver(i, ServerReplyError(f"{url} left a batched request unanswered"))
        finally:
            for future in futures:  # cancelled: the engine is closing
                if not future.done():
                    future.cancel()

    async def _agenerate_here(self, prompt_ids: list[int], sampling: SamplingParams) -> list[Sample]:
        completions, version = await self._request_with_retries(prompt_ids, sampling)
        # the samples a pause("abort") interrupted continue side by side, not one after another
        return list(await asyncio.gather(*(self._finish(prompt_ids, sampling, c, version) for c in completions)))

    async def _finish(self, prompt_ids: list[int], sampling: SamplingParams, c: Completion, version: int) -> Sample:
        """One sample of a request: ``c``, continued from where it stopped while it comes back
        interrupted by ``pause("abort")`` (those tokens carry the version they ran under)."""
        tokens, logprobs = list(c.token_ids), list(c.logprobs)
        versions = self._token_versions(c, version)
        finish = c.finish_reason
        while finish == "abort":
            left = sampling.max_new_tokens - len(tokens)
            if left <= 0:
                finish = "length"
                break
            rest = attrs.evolve(
                sampling, n=1, max_new_tokens=left, min_new_tokens=max(0, sampling.min_new_tokens - len(tokens))
            )
            (more,), more_version = await self._request_with_retries(list(prompt_ids) + tokens, rest)
            tokens += more.token_ids
            logprobs += more.logprobs
            versions += self._token_versions(more, more_version)
            finish = more.finish_reason
        return Sample(
            prompt_ids=list(prompt_ids),
            response_ids=tokens,
            logprobs=logprobs,
            weight_version=min(versions) if versions else version,
            finish_reason=finish,
            token_weight_versions=versions,
        )

    def _token_versions(self, c: Completion, version: int) -> list[int]:
        """The version of each token of ``c``, from a request that started under ``version``: the
        server's labels (``c.versions``) where each lies between ``version`` and the newest
        version an update has labelled the servers with, else ``version`` for every token (a
        server given by URL may hold the labels of an earlier run until its first update)."""
        if c.versions is not None and all(version <= v <= self._newest_label for v in c.versions):
            return list(c.versions)
        return [version] * len(c.token_ids)

    async def agenerate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        check_prompt_and_sampling(prompt_ids, sampling)
        if self._closed:
            raise CoreRLError(f"the {self.env_name} rollout engine is closed")
        future = asyncio.run_coroutine_threadsafe(self._agenerate_here(list(prompt_ids), sampling), self._loop)
        return await asyncio.wrap_future(future)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[list[Sample]]:
        for prompt in prompts:
            check_prompt_and_sampling(prompt, sampling)

        async def all_prompts() -> list[list[Sample]]:
            return list(await asyncio.gather(*(self._agenerate_here(list(p), sampling) for p in prompts)))

        return self._call(all_prompts())

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
            await asyncio.gather(*(self.pause_server(self._client, ep.url, mode) for ep in self.endpoints))
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
            await asyncio.gather(*(self.abort_all(self._client, ep.url) for ep in self.endpoints))
            wait = min(2 * wait, 1.0)

    async def _aresume(self) -> None:
        self._paused_mode = None
        if self.server_paused:
            await asyncio.gather(*(self.resume_server(self._client, ep.url) for ep in self.endpoints))
            self.server_paused = False
        self._running.set()

    def pause(self, mode: str = "wait") -> None:
        self._call(self._apause(mode), timeout=self.options.request_timeout)

    def resume(self) -> None:
        self._call(self._aresume(), timeout=self.options.request_timeout)

    @property
    def paused(self) -> bool:
        return self._paused_mode is not None

    # -- weights --------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def _paused_for_update(self) -> bool:
        """Pause for a weight update unless the caller paused already; True if we paused."""
        if self.paused:
            return False
        self.pause(self.options.update_pause_mode)
        return True

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        raise NotImplementedError(
            f"the {self.env_name} rollout engine runs in another process; use weight_sync=disk or collective"
        )

    def load_weights_from_path(self, path: str | Path, version: int) -> None:
        start = time.perf_counter()
        ours = self._paused_for_update()
        self._newest_label = max(self._newest_label, version)
        try:

            async def reload_all() -> None:
                await asyncio.gather(
                    *(self.reload_from_disk(self._client, ep.url, str(path), version) for ep in self.endpoints)
                )

            self._call(reload_all(), timeout=self.options.weight_sync_timeout)
            self._version = version  # every server has the new weights
            self._weights_path = str(path)
        finally:
            if ours:
                self.resume()
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(_dir_bytes(path))}

    def _backend(self) -> tuple[str, str]:
        """(process-group backend, device of the broadcast tensors)."""
        backend = self.options.weight_sync_backend
        if backend == "auto":
            variant = self.options.env_variant or ("cuda" if _cuda_available() else "cpu")
            backend = "nccl" if variant == "cuda" else "gloo"
        return backend, ("cuda" if backend == "nccl" else "cpu")

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        from core_rl import weight_group

        backend, _ = self._backend()
        address = self.options.weight_sync_address or (self.options.host if not self.options.urls else "127.0.0.1")
        port = free_port(address)
        per_server = self.workers_per_server()
        world_size = 1 + per_server * len(self.endpoints)

        async def join_all() -> None:
            await asyncio.gather(
                *(
                    self.join_weight_group(
                        self._client,
                        ep.url,
                        address=address,
                        port=port,
                        rank_offset=1 + i * per_server,
                        world_size=world_size,
                        backend=backend,
                    )
                    for i, ep in enumerate(self.endpoints)
                )
            )

        joined = asyncio.run_coroutine_threadsafe(join_all(), self._loop)
        try:
            self._group = weight_group.init_group(
                address,
                port,
                world_size,
                backend=backend,
                group_name=self._group_name,
                timeout_s=self.options.weight_sync_timeout,
            )
        except Exception as exc:
            joined.cancel()
            raise CoreRLError(
                f"{self.env_name}: the weight-update group ({backend}, {world_size} ranks at {address}:{port}) did "
                f"not form within {self.options.weight_sync_timeout:.0f} s: {exc}"
            ) from None
        joined.result(self.options.weight_sync_timeout)

    def update_weights_collective(self, state_dict: Mapping[str, Any], version: int) -> None:
        from core_rl import weight_group

        start = time.perf_counter()
        ours = self._paused_for_update()
        self._newest_label = max(self._newest_label, version)
        try:
            self._ensure_group()
            names = list(state_dict)
            dtypes = [str(state_dict[k].dtype).removeprefix("torch.") for k in names]
            shapes = [list(state_dict[k].shape) for k in names]

            async def receive_all() -> None:
                await asyncio.gather(
                    *(
                        self.receive_weights(
                            self._client, ep.url, names=names, dtypes=dtypes, shapes=shapes, version=version
                        )
                        for ep in self.endpoints
                    )
                )

            received = asyncio.run_coroutine_threadsafe(receive_all(), self._loop)
            sent = weight_group.broadcast_tensors(self._group, (state_dict[k] for k in names), self._backend()[1])
            received.result(self.options.weight_sync_timeout)
            self._version = version  # every server has the new weights
            self._weights_path = None
        finally:
            if ours:
                self.resume()
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(sent)}

    # -- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the servers core-rl started (and their children), the HTTP client and the loop."""
        if self._closed:
            return
        try:
            if getattr(self, "_client", None) is not None and self._loop.is_running():
                asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(10)
        except Exception:
            pass
        self._closed = True
        if self._group is not None:
            from core_rl import weight_group

            weight_group.destroy_group(self._group)
            self._group = None
        for ep in getattr(self, "endpoints", []):
            if ep.server is not None:
                ep.server.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def _is_http_error(exc: BaseException) -> bool:
    import httpx

    return isinstance(exc, httpx.HTTPError)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _dir_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


def versions_from_spans(spans: Any, count: int) -> list[int] | None:
    """Per-token weight versions of a sample of ``count`` tokens from a server's version spans
    (``[{"version": label, "start": i, "end": j}, ...]`` over output-token indices, as vLLM and
    SGLang report them). ``None`` (every token then carries the version its request started
    under) where the server gave none or a label that is not one of ours (an integer), e.g. its
    initial ``default``. Raises :class:`ValueError` for spans that leave a token uncovered."""
    if not count:
        return []
    if not spans:
        return None
    versions: list[int | None] = [None] * count
    for span in spans:
        label = str(span["version"])
        if not label.lstrip("-").isdigit():
            return None
        for i in range(int(span["start"]), min(int(span["end"]), count)):
            versions[i] = int(label)
    missing = [i for i, v in enumerate(versions) if v is None]
    if missing:
        raise ValueError(f"weight version spans {spans} leave tokens {missing[:5]} of {count} uncovered")
    return [v for v in versions if v is not None]


def check_prompt_and_sampling(prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
    """Raise :class:`ValueError` for an empty prompt or sampling settings no engine can honour."""
    problems = []
    if len(prompt_ids) == 0:
        problems.append("the prompt is empty")
    if sampling.n < 1:
        problems.append(f"n must be >= 1, got {sampling.n}")
    if sampling.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if not sampling.greedy and not sampling.temperature > 0:
        problems.append(f"temperature must be > 0 unless greedy, got {sampling.temperature}")
    if problems:
        raise ValueError("invalid generation request: " + "; ".join(problems))


async def json_post(
    client: Any, url: str, payload: Mapping[str, Any] | None = None, *, timeout: float | None = None
) -> Any:
    """POST ``payload`` as JSON; return the decoded body. A non-2xx status is a
    :class:`ServerReplyError` quoting the body."""
    kwargs: dict[str, Any] = {"json": payload} if payload is not None else {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    response = await client.post(url, **kwargs)
    if response.status_code >= 300:
        raise ServerReplyError(
            f"POST {url} answered {response.status_code}: {response.text[:500]}", response.status_code
        )
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text
