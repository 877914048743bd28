"""The sync check's side of an SGLang server (``rollout.sync_check``, :mod:`core_rl.sync.check`):
what the server holds, read back through SGLang's own ``POST /get_weights_by_name``.

SGLang loads weights with its own loader (``/update_weights_from_disk``,
``/update_weights_from_distributed``), which core-rl cannot watch, so this side reads back the
parameters themselves after the update. ``/get_weights_by_name`` takes a Hugging Face name (the
Llama model family maps ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` to their
rows of the fused ``qkv_proj`` and ``gate_up_proj``, and a tied ``lm_head.weight`` to the
embedding) and answers the first ``truncate_size`` rows of the parameter, as float32 numbers in
JSON. So only each tensor's first rows can be had cheaply: the engine declares
:data:`FINGERPRINT_PREFIX` (:attr:`core_rl.interfaces.RolloutEngine.fingerprint_prefix`), the
trainer draws its samples from the rows holding that many elements, and this side reads just those
rows of every synced tensor (about 4 KB of JSON per tensor).

A model whose SGLang class answers no name (SGLang implements ``get_weights_by_name`` for a few
families) is reported as unable to say, and the check is skipped with a note.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from core_rl.sync.fingerprint import fingerprint, prefix_numel
from core_rl_server_kit.remote import ServerReplyError, json_post

#: the elements of each tensor's leading rows the check reads back (see the module docstring)
FINGERPRINT_PREFIX = 1024
#: ``/get_weights_by_name`` requests in flight at once per server
CONCURRENT = 8


def synced_shapes(path: str | Path) -> dict[str, list[int]]:
    """The name and shape of every tensor in the ``*.safetensors`` files of ``path`` (read from
    their headers), in file then header order: what a disk update sends."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = list(handle.get_slice(name).get_shape())
    return shapes


async def served_version(client: Any, url: str, timeout: float) -> str | None:
    """The weight version the server at ``url`` labels its output with (``GET /model_info``)."""
    response = await client.get(url + "/model_info", timeout=timeout)
    if response.status_code >= 300:
        raise ServerReplyError(f"GET {url}/model_info answered {response.status_code}: {response.text[:500]}")
    version = response.json().get("weight_version")
    return None if version is None else str(version)


async def held_prefix(client: Any, url: str, name: str, shape: Sequence[int], timeout: float) -> torch.Tensor | None:
    """The first rows of the server's parameter ``name`` (a tensor of ``shape``), those holding
    :data:`FINGERPRINT_PREFIX` elements, as float32 in shape ``(rows, *shape[1:])``; ``None`` where
    the server cannot answer for that name."""
    numel = prefix_numel(shape, FINGERPRINT_PREFIX)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    rows = numel // row if row else 0
    try:
        values = await json_post(
            client, url + "/get_weights_by_name", {"name": name, "truncate_size": rows}, timeout=timeout
        )
    except ServerReplyError:
        return None
    if not isinstance(values, list):
        return None
    held = torch.tensor(values, dtype=torch.float32)
    if held.numel() != numel:
        raise ServerReplyError(f"/get_weights_by_name on {url} answered {held.numel()} numbers for {name}, not {numel}")
    return held.reshape(rows, *shape[1:]) if len(shape) > 1 else held


def checked_share(shapes: Mapping[str, Sequence[int]], version: int, budget: int) -> dict[str, Sequence[int]]:
    """The tensors of ``shapes`` one check reads back: all of them for ``budget`` 0 or where they
    hold at most ``budget`` elements together; else, in an order drawn from ``version`` (a
    different share each sync), tensors while their elements stay within ``budget``, and at least
    one. In ``shapes``' order."""
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    if budget <= 0 or sum(sizes.values()) <= budget:
        return dict(shapes)
    order = sorted(shapes, key=lambda name: hashlib.blake2b(f"{version}:{name}".encode(), digest_size=8).digest())
    chosen: set[str] = set()
    used = 0
    for name in order:
        if chosen and used + sizes[name] > budget:
            continue
        chosen.add(name)
        used += sizes[name]
    return {name: shape for name, shape in shapes.items() if name in chosen}


async def server_fingerprints(
    client: Any,
    url: str,
    shapes: Mapping[str, Sequence[int]],
    version: int,
    dtype: torch.dtype,
    timeout: float,
) -> dict[str, float] | None:
    """The fingerprints (:func:`core_rl.sync.fingerprint.fingerprint`, at ``version``, samples
    drawn within :data:`FINGERPRINT_PREFIX`) of the server's parameters of the tensors ``shapes``
    names, each in the server's ``dtype`` (the float32 numbers it answers are that dtype's values);
    an empty mapping when the server's weights are not of ``version`` (restarted from the model,
    or the update never reached it); ``None`` when it cannot answer for some name."""
    if await served_version(client, url, timeout) != str(version):
        return {}
    gate = asyncio.Semaphore(CONCURRENT)

    async def one(name: str, shape: Sequence[int]) -> torch.Tensor | None:
        async with gate:
            return await held_prefix(client, url, name, shape, timeout)

    names = list(shapes)
    held = await asyncio.gather(*(one(name, shapes[name]) for name in names))
    if any(h is None for h in held):
        return None
    return {name: fingerprint(name, h.to(dtype), version) for name, h in zip(names, held) if h is not None}
