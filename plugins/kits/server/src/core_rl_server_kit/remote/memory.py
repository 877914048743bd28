"""Giving back a server-backed rollout engine's GPU memory while the trainer trains on the same
GPUs (``rollout.sleep_while_training``; :meth:`~core_rl.interfaces.RolloutEngine.release_memory`).

An engine built with ``sleep=True`` starts its servers able to sleep (the plugin's
:meth:`~core_rl_server_kit.remote.ServerRolloutEngine.server_command` adds what its server needs) and then:

- :meth:`MemoryRelease.release_memory` asks every server to drop its KV cache (and CUDA graphs)
  and its weights (plugin hook ``release_server``); nothing may be in flight;
- :meth:`MemoryRelease.restore_memory` asks each server to take back the parts it released
  (plugin hook ``restore_server``): ``weights`` before a weight update, ``kv_cache`` before
  generating. A server restarted since it released (:mod:`core_rl_server_kit.remote.recovery`) starts awake
  and is asked for nothing.

Each server's released parts are kept on its :class:`~core_rl_server_kit.remote.recovery.Endpoint`
(``asleep``). Generating while a server's KV cache is released is an error (the engine's
:meth:`~core_rl_server_kit.remote.generation.Generation._pick`). A server that fails a call is named with
the call in the error. Without ``sleep`` both methods do nothing and send nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from core_rl.errors import CoreRLError
from core_rl.interfaces import MEMORY_PARTS

from core_rl_server_kit.remote.options import ServerOptions
from core_rl_server_kit.remote.recovery import Endpoint
from core_rl_server_kit.remote.wire import ServerReplyError

T = TypeVar("T")


class MemoryRelease:
    """Mixin of :class:`~core_rl_server_kit.remote.ServerRolloutEngine`: memory given back and taken back
    (see the module doc)."""

    env_name: str
    options: ServerOptions
    endpoints: list[Endpoint]
    _client: Any
    _inflight: int
    #: whether the servers were started able to release their memory (``rollout.sleep_while_training``)
    sleeps: bool = False

    if TYPE_CHECKING:  # provided by ServerRolloutEngine and its other parts

        def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, what: str = "") -> T: ...

        async def _each_server(self, call: Callable[[Endpoint], Coroutine[Any, Any, None]], what: str) -> None: ...

    async def release_server(self, client: Any, url: str) -> None:
        """*plugin*: make one server drop its KV cache, CUDA graphs and weights (their contents may
        be lost: a weight update refills the weights). Only called when :attr:`sleeps`."""
        raise NotImplementedError(f"the {self.env_name} rollout engine cannot release its servers' memory")

    async def restore_server(self, client: Any, url: str, parts: tuple[str, ...]) -> None:
        """*plugin*: make one server take back ``parts`` (of :data:`~core_rl.interfaces.MEMORY_PARTS`,
        each released before). Only called when :attr:`sleeps`."""
        raise NotImplementedError(f"the {self.env_name} rollout engine cannot restore its servers' memory")

    @property
    def memory_released(self) -> bool:
        """Whether some server's KV cache is released (it cannot generate)."""
        return any("kv_cache" in ep.asleep for ep in self.endpoints)

    def release_memory(self) -> None:
        if not self.sleeps:
            return
        if self._inflight:
            raise CoreRLError(
                f"{self.env_name} rollout engine: release_memory() with {self._inflight} requests in flight; "
                "release only once generation is over"
            )

        async def one(ep: Endpoint) -> None:
            if set(ep.asleep) == set(MEMORY_PARTS):
                return
            await self._checked(ep, "release its memory", self.release_server(self._client, ep.url))
            ep.asleep = MEMORY_PARTS

        timeout = self.options.request_timeout
        self._call(self._each_server(one, "release its memory"), timeout, "the servers to release their memory")

    def restore_memory(self, parts: Sequence[str] = MEMORY_PARTS) -> None:
        unknown = [p for p in parts if p not in MEMORY_PARTS]
        if unknown:
            raise ValueError(f"memory parts must be among {', '.join(MEMORY_PARTS)}, got {unknown}")
        if not self.sleeps:
            return

        async def one(ep: Endpoint) -> None:
            wanted = tuple(p for p in MEMORY_PARTS if p in parts and p in ep.asleep)
            if not wanted:
                return  # never released, or restarted since (a new server starts awake)
            what = f"take back its {' and '.join(wanted)} memory"
            await self._checked(ep, what, self.restore_server(self._client, ep.url, wanted))
            ep.asleep = tuple(p for p in ep.asleep if p not in wanted)

        what = f"the servers to take back their {' and '.join(parts)} memory"
        self._call(self._each_server(one, "take back its memory"), self.options.request_timeout, what)

    async def _checked(self, ep: Endpoint, what: str, call: Coroutine[Any, Any, None]) -> None:
        """Await ``call``; a server's error answer becomes one naming the server and ``what`` it
        was asked (a transport failure goes to recovery as it is)."""
        try:
            await call
        except ServerReplyError as exc:
            server = ep.name if ep.url in ep.name else f"{ep.name} ({ep.url})"
            raise ServerReplyError(
                f"server {server} did not {what} (rollout.sleep_while_training): {exc}", exc.status
            ) from None
