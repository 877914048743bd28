"""Serving LoRA adapters (``rollout.lora_sync: adapter``, :mod:`core_rl.sync.lora`): the server
flags, and the adapter name of each weight version.

A server started with a ``lora_rank`` loads each version's adapter directory through the plugin's
weight-update route (:mod:`core_rl_vllm.server_side.core_rl_vllm_routes`: vLLM's own
``load_lora_adapter`` inside the server, with the scheduler paused, the weight version labelled and
the prefix cache dropped, as for full weights), under :func:`core_rl.sync.lora.adapter_name`, and unloads the
previous version's name; later requests name the new adapter as their ``model``. vLLM's
``/v1/load_lora_adapter`` route would need ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` and leave the
tokens' weight versions unlabelled.
"""

from __future__ import annotations

from typing import Any

from core_rl.sync import NAME_PREFIX, adapter_name

#: the values vLLM accepts for ``--max-lora-rank`` (``vllm.config.lora.MaxLoRARanks`` of the pinned vLLM)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: adapters a server keeps in host memory: the one being served and the one replacing it
CPU_LORAS = 2


def max_lora_rank(rank: int) -> int:
    """The least ``--max-lora-rank`` vLLM accepts that holds an adapter of rank ``rank``;
    :class:`ValueError` above the largest."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA adapters of rank at most {VLLM_LORA_RANKS[-1]}, not {rank}")


def server_args(rank: int) -> list[str]:
    """vLLM's flags for serving adapters of rank up to ``rank`` (none for 0)."""
    if rank <= 0:
        return []
    return ["--enable-lora", "--max-lora-rank", str(max_lora_rank(rank)), "--max-cpu-loras", str(CPU_LORAS)]


def adapter_update(path: str, version: int) -> dict[str, Any]:
    """The ``lora`` part of a weight-update request that loads the adapter directory ``path`` as
    version ``version``. The server loads it afresh where it knows the name already (a trainer
    resumed against servers that outlived it reloads the version they serve), then unloads every
    other adapter named with :data:`NAME_PREFIX` (the previous version, and any an earlier trainer
    process left)."""
    return {"name": adapter_name(version), "path": str(path), "unload_prefix": NAME_PREFIX}
