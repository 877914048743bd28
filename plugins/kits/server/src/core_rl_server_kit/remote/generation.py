"""Generation through a server-backed rollout engine's servers: each request goes to the least
busy server holding the newest weights, under a bound on the requests in flight, is retried whole
with exponential backoff when it fails (a dead server is handled by :mod:`core_rl_server_kit.remote.recovery`
first), and may travel in one HTTP round trip with the other requests for its server that arrive
within ``batch_window_s`` (:meth:`~core_rl_server_kit.remote.ServerRolloutEngine.request_batch`). A request
interrupted by ``pause("abort")`` is continued after ``resume`` from the tokens it had.

A prompt with pixel inputs (``media``, for an engine whose config class claims ``multimodal``) goes
to the plugin's :meth:`~core_rl_server_kit.remote.ServerRolloutEngine.request` as its ``media``
keyword, on its own (never batched), continuations included; a prompt without them is sent as before."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from core_rl.errors import CoreRLError
from core_rl.interfaces import SamplingParams
from core_rl.protocol import Sample
from core_rl.reliability import PROGRESS

from core_rl_server_kit.processes import ServerError
from core_rl_server_kit.remote.options import ServerOptions
from core_rl_server_kit.remote.recovery import Endpoint
from core_rl_server_kit.remote.wire import (
    Completion,
    ServerReplyError,
    check_prompt_and_sampling,
    describe,
    is_transport_error,
)

T = TypeVar("T")


class Generation:
    """Mixin of :class:`~core_rl_server_kit.remote.ServerRolloutEngine`: generation (see the module doc)."""

    env_name: str
    options: ServerOptions
    endpoints: list[Endpoint]
    batches_requests: bool
    _client: Any
    _loop: asyncio.AbstractEventLoop
    _closed: bool
    _fatal: ServerError | None
    _version: int
    _newest_label: int
    _running: asyncio.Event
    _slots: asyncio.Semaphore
    _idle: asyncio.Condition
    _inflight: int
    _batches: dict[str, list[tuple[list[int], SamplingParams, asyncio.Future]]]
    _flushes: set[asyncio.Task]

    # the plugin hooks request() and request_batch() are ServerRolloutEngine's
    if TYPE_CHECKING:  # provided by the engine's other parts

        async def _recover(
            self, ep: Endpoint, generation: int, exc: BaseException | None, *, during: str, reload: bool = True
        ) -> bool: ...

        def _current(self, ep: Endpoint) -> bool: ...

        def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, what: str = "") -> T: ...

    def _pick(self) -> Endpoint:
        """The least busy server that holds the newest weights."""
        if any("kv_cache" in ep.asleep for ep in self.endpoints):
            raise CoreRLError(
                f"{self.env_name} rollout engine: asked to generate while its servers' memory is released "
                "(release_memory); restore_memory() first"
            )
        ready = [ep for ep in self.endpoints if self._current(ep)]
        if not ready:  # recovery stops the run before this can happen; never send to stale weights
            held = ", ".join(f"{ep.name}: {ep.version}" for ep in self.endpoints)
            raise ServerError(f"no server holds the weights of version {self._version} (versions held: {held})")
        return min(ready, key=lambda ep: ep.inflight)

    async def _request_with_retries(
        self, prompt_ids: list[int], sampling: SamplingParams, media: Mapping[str, Any] | None = None
    ) -> tuple[list[Completion], int]:
        """The completions of one request and the weight version it started under."""
        last: BaseException | None = None
        ep: Endpoint | None = None
        attempt = 0
        while attempt <= self.options.max_retries:
            await self._running.wait()
            async with self._slots:
                await self._running.wait()
                ep = self._pick()
                generation, version = ep.generation, self._version
                ep.inflight += 1
                self._inflight += 1
                try:
                    with PROGRESS.call(f"{self.env_name} server {ep.name} ({ep.url}): generation request"):
                        completions = await asyncio.wait_for(
                            self._send(ep.url, prompt_ids, sampling, media), self.options.request_timeout
                        )
                    if len(completions) != sampling.n:
                        raise ServerReplyError(f"{ep.name} returned {len(completions)} samples, asked for {sampling.n}")
                    ep.served = True
                    return completions, version
                except ServerReplyError as exc:
                    if not exc.retryable:
                        raise
                    last = exc
                except (TimeoutError, OSError) as exc:
                    last = exc
                except Exception as exc:
                    if not is_transport_error(exc):
                        raise
                    last = exc
                finally:
                    ep.inflight -= 1
                    self._inflight -= 1
                    async with self._idle:
                        self._idle.notify_all()
            if await self._recover(ep, generation, last, during="while generating"):
                continue  # the server died and runs again: the request goes again, not counted as a retry
            if attempt < self.options.max_retries:
                await asyncio.sleep(self.options.retry_backoff * 2**attempt)
            attempt += 1
        assert ep is not None and last is not None
        what = f"a request failed {self.options.max_retries + 1} times; last error: {describe(last)}"
        if ep.server is not None:
            raise ep.server.failure(what)
        raise ServerError(f"server {ep.name}: {what}")

    def _send(
        self, url: str, prompt_ids: list[int], sampling: SamplingParams, media: Mapping[str, Any] | None = None
    ) -> Awaitable[list[Completion]]:
        """The completions of one request to ``url``: its own HTTP request, or a place in the batch
        that leaves for ``url`` ``batch_window_s`` after its first request (see the module doc); a
        request with ``media`` always goes on its own."""
        if media is not None:
            return self.request(self._client, url, prompt_ids, sampling, media=media)
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
            with PROGRESS.call(f"request_batch of {len(batch)} requests to {url}"):
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

    async def _agenerate_here(
        self, prompt_ids: list[int], sampling: SamplingParams, media: Mapping[str, Any] | None = None
    ) -> list[Sample]:
        completions, version = await self._request_with_retries(prompt_ids, sampling, media)
        # the samples a pause("abort") interrupted continue side by side, not one after another
        return list(await asyncio.gather(*(self._finish(prompt_ids, sampling, c, version, media) for c in completions)))

    async def _finish(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        c: Completion,
        version: int,
        media: Mapping[str, Any] | None = None,
    ) -> Sample:
        """One sample of a request: ``c``, continued from where it stopped while it comes back
        interrupted by ``pause("abort")`` (those tokens carry the version they ran under). A
        continuation sends the tokens so far as part of its prompt, so the server's frequency and
        presence penalties do not count them (the hf engine's do: it continues in process)."""
        tokens, logprobs = list(c.token_ids), list(c.logprobs)
        versions = self._token_versions(c, version)
        finish, routes = c.finish_reason, c.routes
        while finish == "abort":
            left = sampling.max_new_tokens - len(tokens)
            if left <= 0:
                finish = "length"
                break
            rest = attrs.evolve(
                sampling, n=1, max_new_tokens=left, min_new_tokens=max(0, sampling.min_new_tokens - len(tokens))
            )
            (more,), more_version = await self._request_with_retries(list(prompt_ids) + tokens, rest, media)
            tokens += more.token_ids
            logprobs += more.logprobs
            versions += self._token_versions(more, more_version)
            finish, routes = more.finish_reason, more.routes  # the continuation's routes cover every position
        return Sample(
            prompt_ids=list(prompt_ids),
            response_ids=tokens,
            logprobs=logprobs,
            weight_version=min(versions) if versions else version,
            finish_reason=finish,
            token_weight_versions=versions,
            routed_experts=None if routes is None else sample_routes(routes, len(prompt_ids) + len(tokens)),
        )

    def _token_versions(self, c: Completion, version: int) -> list[int]:
        """The version of each token of ``c``, from a request that started under ``version``: the
        server's labels (``c.versions``) where each lies between ``version`` and the newest
        version an update has labelled the servers with, else ``version`` for every token (a
        server given by URL may hold the labels of an earlier run until its first update)."""
        if c.versions is not None and all(version <= v <= self._newest_label for v in c.versions):
            return list(c.versions)
        return [version] * len(c.token_ids)

    async def agenerate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, *, media: Mapping[str, Any] | None = None
    ) -> list[Sample]:
        check_prompt_and_sampling(prompt_ids, sampling)
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise CoreRLError(f"the {self.env_name} rollout engine is closed")
        future = asyncio.run_coroutine_threadsafe(self._agenerate_here(list(prompt_ids), sampling, media), self._loop)
        return await relay(future)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        media: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[list[Sample]]:
        for prompt in prompts:
            check_prompt_and_sampling(prompt, sampling)
        per_prompt = list(media) if media is not None else [None] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} media entries for {len(prompts)} prompts")

        async def all_prompts() -> list[list[Sample]]:
            return list(
                await asyncio.gather(*(self._agenerate_here(list(p), sampling, m) for p, m in zip(prompts, per_prompt)))
            )

        return self._call(all_prompts(), what=f"{len(prompts)} prompts to be generated")


def relay(future: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """An asyncio future of the running loop that takes ``future``'s outcome (cancelling it
    cancels ``future``). Unlike :func:`asyncio.wrap_future`, an outcome that arrives after the
    caller's loop closed (a run ending with requests still retrying) is dropped, not reported from
    the engine's thread as a "loop is closed" traceback."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def settle(done: concurrent.futures.Future[T]) -> None:
        if waiter.done():
            return
        if done.cancelled():
            waiter.cancel()
        elif done.exception() is not None:
            waiter.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            waiter.set_result(done.result())

    def deliver(done: concurrent.futures.Future[T]) -> None:
        try:
            loop.call_soon_threadsafe(settle, done)
        except RuntimeError:  # the caller's loop is closed: nobody waits for this any more
            pass

    waiter.add_done_callback(lambda w: future.cancel() if w.cancelled() else None)
    future.add_done_callback(deliver)
    return waiter


def sample_routes(routes: Any, positions: int) -> Any:
    """:attr:`Sample.routed_experts` (int16 ``[positions, layers, top_k]``) of a server's routes
    (:attr:`Completion.routes`, one row per position fed to the model): the rows it has, -1 on the
    rest (the last token, never fed to the model)."""
    import torch
    from core_rl_train_kit.moe import NO_ROUTE, ROUTE_DTYPE

    given = torch.as_tensor(routes).to(ROUTE_DTYPE)
    if given.ndim != 3 or given.shape[0] > positions:
        raise ServerReplyError(
            f"routed experts of shape {tuple(given.shape)} for {positions} prompt and response tokens"
        )
    out = torch.full((positions, *given.shape[1:]), NO_ROUTE, dtype=ROUTE_DTYPE)
    out[: given.shape[0]] = given
    return out
