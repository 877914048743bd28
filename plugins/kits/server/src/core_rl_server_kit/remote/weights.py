"""Weight updates of a server-backed rollout engine: from a Hugging Face directory on disk, or
broadcast over a process group that the trainer's main rank forms with the servers' workers
(:mod:`core_rl_server_kit.weight_group`).

An update runs with generation paused (by the caller, or here with ``update_pause_mode``); the
engine's weight version advances only once every server has the new weights. A server that dies
inside the update window (from ``pause`` to ``resume``) is restarted as
:mod:`core_rl_server_kit.remote.recovery` allows and gets this update's weights: the directory, or, for a
collective, a new group formed with every server and the update's tensors broadcast again (the
engine keeps a reference to them until ``resume``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from core_rl.reliability import PROGRESS

from core_rl_server_kit.processes import ServerError, free_port
from core_rl_server_kit.remote.options import ServerOptions
from core_rl_server_kit.remote.recovery import Endpoint
from core_rl_server_kit.remote.wire import describe

T = TypeVar("T")
UPDATE = "during a weight update"


class WeightSync:
    """Mixin of :class:`~core_rl_server_kit.remote.ServerRolloutEngine`: weight updates (see the module doc)."""

    env_name: str
    options: ServerOptions
    endpoints: list[Endpoint]
    _client: Any
    _loop: asyncio.AbstractEventLoop
    _version: int
    _newest_label: int
    _weights_path: str | None
    _held: tuple[Mapping[str, Any], int] | None
    _group: Any
    _group_name: str
    _group_members: list[int]  # each server's restart generation when the group formed
    last_sync: dict[str, float]

    if TYPE_CHECKING:  # provided by ServerRolloutEngine and its other parts

        @property
        def paused(self) -> bool: ...

        def pause(self, mode: str = "wait") -> None: ...

        def resume(self) -> None: ...

        def workers_per_server(self) -> int: ...

        def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None, what: str = "") -> T: ...

        async def _recover(
            self, ep: Endpoint, generation: int, exc: BaseException | None, *, during: str, reload: bool = True
        ) -> bool: ...

        def _call_failed(self, ep: Endpoint, what: str, exc: BaseException) -> BaseException: ...

        async def reload_from_disk(self, client: Any, url: str, path: str, version: int) -> None: ...

        async def join_weight_group(
            self, client: Any, url: str, *, address: str, port: int, rank_offset: int, world_size: int, backend: str
        ) -> None: ...

        async def receive_weights(
            self, client: Any, url: str, *, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int
        ) -> None: ...

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

    # -- from disk ------------------------------------------------------------------------------

    def load_weights_from_path(self, path: str | Path, version: int) -> None:
        start = time.perf_counter()
        ours = self._paused_for_update()
        self._newest_label = max(self._newest_label, version)
        try:
            what = f"the servers to load the weights of version {version} from {path}"
            self._call(self._reload_all(str(path), version), self.options.weight_sync_timeout, what)
            self._version = version  # every server has the new weights
            self._weights_path = str(path)
        finally:
            if ours:
                self.resume()
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(_dir_bytes(path))}

    async def _reload_all(self, path: str, version: int) -> None:
        async def one(ep: Endpoint) -> None:
            while True:
                generation = ep.generation
                try:
                    await self.reload_from_disk(self._client, ep.url, path, version)
                except Exception as exc:
                    if await self._recover(ep, generation, exc, during=UPDATE, reload=False):
                        continue  # restarted: load into the new server
                    raise self._call_failed(ep, f"load the weights of version {version}", exc) from None
                ep.version, ep.served = version, True
                return

        await asyncio.gather(*(one(ep) for ep in self.endpoints))

    # -- over a collective ----------------------------------------------------------------------

    def _backend(self) -> tuple[str, str]:
        """(process-group backend, device of the broadcast tensors): see :func:`auto_weight_backend`."""
        backend = self.options.weight_sync_backend
        if backend == "auto":
            variant = self.options.env_variant or ("cuda" if _cuda_available() else "cpu")
            backend = auto_weight_backend(self.options, variant)
        return backend, ("cuda" if backend == "nccl" else "cpu")

    def update_weights_collective(self, state_dict: Mapping[str, Any], version: int) -> None:
        start = time.perf_counter()
        ours = self._paused_for_update()
        self._newest_label = max(self._newest_label, version)
        self._held = (state_dict, version)  # sent again to a server restarted before resume()
        sent = 0
        try:
            sent = self._send_collective(state_dict, version)
            self._version = version  # every server has the new weights
            self._weights_path = None
        finally:
            if ours:
                self.resume()
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": float(sent)}

    def _restart_dead(self) -> None:
        """Restart (as recovery allows) every managed server that died, before a broadcast."""
        for ep in self.endpoints:
            if not ep.alive():
                self._call(self._recover(ep, ep.generation, None, during=UPDATE, reload=False), None, "a restart")

    def _send_collective(self, state_dict: Mapping[str, Any], version: int) -> int:
        """Broadcast ``state_dict`` to every server's workers (forming the group first if there is
        none); a server that dies meanwhile is restarted and everything is sent again."""
        from core_rl_server_kit import weight_group

        names = list(state_dict)
        shapes = [list(state_dict[k].shape) for k in names]
        timeout = self.options.weight_sync_timeout
        while True:
            self._restart_dead()
            members = [ep.generation for ep in self.endpoints]
            if self._group is not None and members != self._group_members:
                self._drop_group()  # a server restarted since the group formed: it is not in it
            if self._group is None:
                try:
                    self._form_group()
                except ServerError:
                    if all(ep.alive() for ep in self.endpoints):
                        raise
                    continue  # a server died while joining: restart it and form the group again
                self._group_members = members
            # the servers' own dtypes (known once the group formed), so the link carries what they keep
            wire = self.wire_dtypes(names, [state_dict[k].dtype for k in names])
            dtypes = [str(d).removeprefix("torch.") for d in wire]

            async def receive_all(dtypes: list[str] = dtypes) -> None:
                await asyncio.gather(
                    *(
                        self.receive_weights(
                            self._client, ep.url, names=names, dtypes=dtypes, shapes=shapes, version=version
                        )
                        for ep in self.endpoints
                    )
                )

            received = asyncio.run_coroutine_threadsafe(receive_all(), self._loop)
            error: BaseException | None = None
            sent = 0
            try:
                tensors = (state_dict[k] for k in names)
                sent = weight_group.broadcast_tensors(self._group, tensors, self._backend()[1], wire)
            except Exception as exc:
                error = exc
                self._drop_group()  # the servers still receiving fail at once instead of waiting
            try:
                received.result(timeout)
            except concurrent.futures.TimeoutError:
                received.cancel()
                error = error or TimeoutError(f"the servers did not load the broadcast weights within {timeout:.0f} s")
            except Exception as exc:
                error = error or exc
            if error is None:
                for ep in self.endpoints:
                    ep.version, ep.served = version, True
                return sent
            self._drop_group()
            if all(ep.alive() for ep in self.endpoints) and members == [ep.generation for ep in self.endpoints]:
                raise ServerError(
                    f"{self.env_name}: the weight update of version {version} over the collective failed: "
                    f"{describe(error)}"
                ) from None
            # a server died (or was restarted meanwhile): restart it, form a new group, send again

    # -- the sync check -------------------------------------------------------------------------

    async def fingerprints_of(self, client: Any, url: str, version: int) -> dict[str, dict[str, float]] | None:
        """The sync check's fingerprints (:mod:`core_rl.sync.fingerprint`) of the tensors the server
        at ``url`` loaded in its last update, as they arrived, by worker (an empty mapping for a
        worker whose last update was not of ``version``); ``None``: the server cannot say. Default:
        ``None``."""
        return None

    def weight_fingerprints(self, version: int) -> dict[str, dict[str, float]] | None:
        """Every server's :meth:`fingerprints_of`, by ``server NAME (URL) WORKER``; ``None`` when a
        server cannot say."""

        async def one(ep: Endpoint) -> dict[str, dict[str, float]] | None:
            with PROGRESS.call(f"{self.env_name} server {ep.name} ({ep.url}): weight fingerprints"):
                try:
                    return await self.fingerprints_of(self._client, ep.url, version)
                except Exception as exc:
                    raise self._call_failed(ep, f"report the weights of version {version}", exc) from None

        async def every() -> list[dict[str, dict[str, float]] | None]:
            return list(await asyncio.gather(*(one(ep) for ep in self.endpoints)))

        answers = self._call(every(), self.options.weight_sync_timeout, "the servers' weight fingerprints")
        if any(answer is None for answer in answers):
            return None
        return {
            f"server {ep.name} ({ep.url}) {worker}": prints
            for ep, answer in zip(self.endpoints, answers)
            for worker, prints in (answer or {}).items()
        }

    def fingerprint_dtypes(self, names: list[str], dtypes: list[Any], mode: str) -> list[Any]:
        """The servers fingerprint the tensors as they arrive: in :meth:`wire_dtypes` over a
        collective, as written to the files by disk."""
        return self.wire_dtypes(names, dtypes) if mode == "collective" else list(dtypes)

    def wire_dtypes(self, names: list[str], dtypes: list[Any]) -> list[Any]:
        """The dtype each weight travels in over the collective (``torch.dtype`` objects, in order): the
        one the servers would convert it to when loading it, where an engine knows that exactly (a
        float32 trainer's weights then cross the link as a bfloat16 server's half the bytes, with the
        same values the server would have made of them), else ``dtypes`` as they are. Called once
        the group has formed. Default: ``dtypes``."""
        return list(dtypes)

    def _drop_group(self) -> None:
        if self._group is not None:
            from core_rl_server_kit import weight_group

            weight_group.destroy_group(self._group)
            self._group = None

    def _form_group(self) -> None:
        """Form the weight-update group: the trainer is rank 0, each server's workers join. Raises
        :class:`ServerError` when a server fails to join or the group does not form in time."""
        from core_rl_server_kit import weight_group

        backend, _ = self._backend()
        address = self.options.weight_sync_address or (self.options.host if not self.options.urls else "127.0.0.1")
        port = free_port(address)
        per_server = self.workers_per_server()
        world_size = 1 + per_server * len(self.endpoints)
        timeout = self.options.weight_sync_timeout
        what = f"the weight-update group ({backend}, {world_size} ranks at {address}:{port})"
        self._group_name = name = weight_group.new_group_name()  # before the joins: the plugins send it

        async def join(i: int, ep: Endpoint) -> None:
            try:
                await self.join_weight_group(
                    self._client,
                    ep.url,
                    address=address,
                    port=port,
                    rank_offset=1 + i * per_server,
                    world_size=world_size,
                    backend=backend,
                )
            except Exception as exc:
                raise self._call_failed(ep, f"join {what}", exc) from None

        async def join_all() -> None:
            await asyncio.gather(*(join(i, ep) for i, ep in enumerate(self.endpoints)))

        joined = asyncio.run_coroutine_threadsafe(join_all(), self._loop)
        formed: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def init() -> None:  # in a thread of its own: a server that fails to join ends the wait at once
            try:
                group = weight_group.init_group(
                    address, port, world_size, backend=backend, group_name=name, timeout_s=timeout
                )
                formed.set_result(group)
            except BaseException as exc:
                formed.set_exception(exc)

        threading.Thread(target=init, name=f"{self.env_name}-weight-group", daemon=True).start()
        done, _ = concurrent.futures.wait([joined, formed], timeout, concurrent.futures.FIRST_EXCEPTION)
        for future in (joined, formed):
            if future in done and future.exception() is not None:
                joined.cancel()
                error = future.exception()
                if isinstance(error, ServerError):
                    raise error
                raise ServerError(f"{self.env_name}: {what} did not form: {describe(error)}")
        if len(done) < 2:
            joined.cancel()
            raise ServerError(f"{self.env_name}: {what} did not form within {timeout:.0f} s")
        self._group = formed.result()

    def _resend_after_restart(self) -> None:
        """At ``resume``: a server restarted since the collective update it belongs to gets the
        update's weights again (while the engine still holds them)."""
        if self._held is None or all(ep.version == self._version for ep in self.endpoints):
            return
        state_dict, version = self._held
        if version == self._version:
            self._send_collective(state_dict, version)


def auto_weight_backend(options: ServerOptions, variant: str) -> str:
    """``weight_sync_backend: auto``: ``nccl`` for GPU servers that have GPUs of their own (connected
    by ``urls``, started with ``CUDA_VISIBLE_DEVICES`` in ``env``, or on ``gpus`` that leave out GPU
    0, where the trainer's rank 0 is), else ``gloo``. NCCL refuses two ranks of one group on one GPU;
    gloo stages the tensors through host memory instead."""
    own_gpus = (
        bool(options.urls) or "CUDA_VISIBLE_DEVICES" in options.env or (bool(options.gpus) and 0 not in options.gpus)
    )
    return "nccl" if variant == "cuda" and own_gpus else "gloo"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _dir_bytes(path: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
