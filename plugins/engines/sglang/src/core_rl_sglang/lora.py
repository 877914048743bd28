"""Serving LoRA adapters (``rollout.lora_sync: adapter``, :mod:`core_rl.sync.lora`): the server
flags, and loading each version's adapter.

A server started with a ``lora_rank`` loads each version's adapter directory with SGLang's own
routes (:func:`load_version`): ``POST /load_lora_adapter`` under
:func:`core_rl.sync.lora.adapter_name` (a name the server serves already, as after a trainer resumed
against servers that outlived it, is unloaded and loaded afresh), ``POST /update_weight_version``
to label the tokens sampled from then on with the version (as SGLang's full-weight updates do
through their ``weight_version``), then ``POST /unload_lora_adapter`` for every other adapter named
with :data:`core_rl.sync.lora.NAME_PREFIX`. Later ``/generate`` requests name the adapter in
``lora_path``. SGLang keys its prefix cache by adapter, so a new name per version never meets a
stale entry, and no flush is needed. The engine pauses the server around the load, as for full
weights (``update_pause_mode`` ``wait`` or ``abort``: :func:`core_rl.sync.lora.problems` refuses
``keep``).

The sync check (``rollout.sync_check``) of an adapter sync (:func:`adapter_fingerprints`): SGLang
reports the directory each adapter it serves was loaded from (``GET /v1/models``: an adapter's
``root``), so the check fingerprints the files of the directory the server loaded under this
version's name, as vLLM's server side does for the directory its handler loaded.

On a CPU-only torch SGLang's LoRA layers and its ``torch_native`` LoRA backend still ask for pinned
host memory, which has no allocator there; the engine has such servers start with
:data:`PINLESS_VARIABLE` set (:mod:`core_rl_sglang.server_side.core_rl_sglang_pinless`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from core_rl.sync import NAME_PREFIX, adapter_name
from core_rl.sync.fingerprint import file_samples, fold
from core_rl_server_kit.remote import ServerReplyError

from core_rl_sglang.wire import checked_post

#: adapters a server holds in one batch: the one being served and the base model (requests
#: naming no adapter, e.g. a merged sync's)
LORAS_PER_BATCH = 2
#: SGLang's LoRA backend on CPU (its default, ``csgmv``, runs Triton kernels)
CPU_BACKEND = "torch_native"
#: set to 1 in a CPU server's environment: pinned host memory requests become ordinary ones
PINLESS_VARIABLE = "CORE_RL_SGLANG_PINLESS"


def server_args(rank: int, cpu: bool) -> list[str]:
    """SGLang's flags for serving adapters of rank up to ``rank`` on every module SGLang can adapt
    (none for 0)."""
    if rank <= 0:
        return []
    argv = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", "all"]
    argv += ["--max-loras-per-batch", str(LORAS_PER_BATCH)]
    return argv + (["--lora-backend", CPU_BACKEND] if cpu else [])


async def adapter_roots(client: Any, url: str, timeout: float) -> dict[str, str]:
    """The adapters core-rl had the server at ``url`` load, by name, each with the directory it was
    loaded from (``GET /v1/models``: SGLang lists each adapter with its path as ``root``)."""
    response = await client.get(url + "/v1/models", timeout=timeout)
    if response.status_code >= 300:
        raise ServerReplyError(f"GET {url}/v1/models answered {response.status_code}: {response.text[:300]}")
    cards = response.json().get("data", [])
    return {str(m["id"]): str(m.get("root") or "") for m in cards if str(m.get("id", "")).startswith(NAME_PREFIX)}


async def served_adapters(client: Any, url: str, timeout: float) -> list[str]:
    """The names of the adapters core-rl had the server at ``url`` load."""
    return list(await adapter_roots(client, url, timeout))


async def adapter_fingerprints(
    client: Any, url: str, version: int, timeout: float, prefix: int | None = None
) -> dict[str, float]:
    """The sync check's fingerprints (:func:`core_rl.sync.fingerprint.file_samples` at ``version``
    within ``prefix``, folded in each tensor's own dtype) of every tensor in the directory the
    server at ``url`` loaded the adapter of ``version`` from; empty when it serves no adapter under
    that version's name (a server restarted, or a load that never reached it)."""
    root = (await adapter_roots(client, url, timeout)).get(adapter_name(version))
    if not root:
        return {}
    samples = await asyncio.to_thread(file_samples, root, version, prefix)  # a memory map: few pages read
    return {name: fold(tensor) for name, tensor in samples.items()}


async def load_version(client: Any, url: str, path: str, version: int, timeout: float) -> str:
    """Have the server at ``url`` serve the adapter directory ``path`` as version ``version`` (see
    the module docstring); the name requests give as their ``lora_path``."""
    name = adapter_name(version)
    served = await served_adapters(client, url, timeout)
    if name in served:
        await checked_post(client, url + "/unload_lora_adapter", {"lora_name": name}, timeout)
    await checked_post(client, url + "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout)
    label = {"new_version": str(version), "abort_all_requests": False}
    await checked_post(client, url + "/update_weight_version", label, timeout)
    for old in served:
        if old != name:
            await checked_post(client, url + "/unload_lora_adapter", {"lora_name": old}, timeout)
    return name
