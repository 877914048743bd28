"""How much of a GPU the inference servers may take where they share it with the trainer.

Servers core-rl starts on one of the trainer's GPUs (``rollout.engine.server.gpus``, as the
placement or the user chose them) size themselves from the memory free when they start: vLLM
takes ``gpu_memory_utilization`` of the GPU and refuses to start unless that much is free; SGLang
takes a share of what is free. The trainer's own memory is then already in use, except what its
first optimiser step still allocates (gradients, optimiser state: the ``pending`` bytes of
:func:`core_rl.loops.auto_budget.pending_bytes`). So, on rank 0, from its device
(:func:`shared_gpu`; the other ranks' GPUs hold about the same):

- :func:`fit_colocated_memory`: an engine config with a ``with_colocated_memory(budget, total)``
  method (the ``vllm`` plugin's) gets the bytes each server may take,
  :attr:`SharedGPU.budget` = ``free - pending - COLOCATED_RESERVE x total``, shared by the
  servers on one GPU;
- :func:`held_for_trainer`: while the servers start, the ``pending`` bytes are held on the device,
  so that a server sizing itself from free memory (SGLang) leaves them to the trainer; the other
  ranks of rank 0's node hold theirs meanwhile where a server starts on their GPU
  (:func:`held_by_peer`).

:func:`release_cached_memory` gives torch's cached blocks back to the driver first: they are free
to the trainer but not to another process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from core_rl.config.checks import MachineInfo
from core_rl.config.schema import RunConfig
from core_rl.errors import warn
from core_rl.launch.gpus import gpus_per_server, resolve_server_gpus, servers_gpus
from core_rl.loops.auto_budget import free_bytes, pending_bytes
from core_rl.roles.built_engines import BuiltEngine

#: the share of a GPU's memory left unclaimed where servers share it with the trainer: both
#: processes' CUDA contexts, NCCL's buffers, the allocators' fragmentation
COLOCATED_RESERVE = 0.05


@attrs.frozen
class SharedGPU:
    """Rank 0's GPU as the servers on it find it: ``total`` bytes, ``free`` now (torch's unused
    cache counted, it is given back before they start), ``pending`` (the trainer's first step
    still allocates that much) and ``servers`` started on each of the trainer's GPUs."""

    device: Any
    total: int
    free: int
    pending: int
    servers: int = 1

    @property
    def budget(self) -> int:
        """Bytes each server may take: ``(free - pending - COLOCATED_RESERVE x total) / servers``."""
        return (self.free - self.pending - int(COLOCATED_RESERVE * self.total)) // self.servers


def shared_gpu(
    engine_config: Any, built: Sequence[BuiltEngine], machine: MachineInfo, local_rank: int = 0
) -> SharedGPU | None:
    """The GPU of the rank ``local_rank`` of rank 0's node where servers of ``engine_config`` start
    on it (``server.gpus``: its index is ``local_rank``) and this rank's engines (``built``)
    compute on CUDA; ``None`` elsewhere (servers given by URL, on GPUs of their own or chosen by
    ``server.env``, a trainer on the CPU)."""
    server = getattr(engine_config, "server", None)
    devices = [b.device for b in built if b.device.type == "cuda"]
    if server is None or server.urls or not server.gpus or not devices or local_rank >= machine.local_world_size:
        return None
    shares = servers_gpus(server.gpus, server.num_servers, gpus_per_server(engine_config))
    per_gpu = sum(local_rank in share for share in shares)
    if per_gpu == 0:
        return None
    device = devices[0]
    release_cached_memory()
    total = torch.cuda.mem_get_info(device)[1]
    return SharedGPU(device, total, free_bytes(device), pending_bytes(built, device), per_gpu)


def fit_colocated_memory(engine_config: Any, shared: SharedGPU | None) -> tuple[Any, str | None]:
    """``engine_config`` through its ``with_colocated_memory(budget, total)`` on a shared GPU,
    with the plugin's note; unchanged without a shared GPU or without the method."""
    fit = getattr(engine_config, "with_colocated_memory", None)
    if shared is None or not callable(fit):
        return engine_config, None
    return fit(shared.budget, shared.total)


@contextlib.contextmanager
def held_for_trainer(shared: SharedGPU | None) -> Iterator[None]:
    """Hold ``shared.pending`` bytes on its device for the block (the servers' start), then give
    them back to the driver; nothing without a shared GPU or pending bytes."""
    if shared is None or shared.pending <= 0:
        yield
        return
    try:
        held = torch.empty(shared.pending, dtype=torch.uint8, device=shared.device)
    except torch.OutOfMemoryError:  # the estimate is above what is free: start the servers without it
        warn(
            f"could not hold {shared.pending / 2**30:.1f} GiB on {shared.device} for the trainer's "
            f"first step while the servers start ({shared.free / 2**30:.1f} GiB free): they may leave it too little"
        )
        yield
        return
    try:
        yield
    finally:
        del held
        release_cached_memory()


def held_by_peer(cfg: RunConfig, built: Sequence[BuiltEngine], is_main: bool) -> contextlib.AbstractContextManager:
    """On a rank other than 0 and on rank 0's node (``GROUP_RANK`` 0 under ``torchrun``), while
    rank 0 starts the servers: :func:`held_for_trainer` on this rank's GPU where a server starts on
    it (the placement's choice, :func:`~core_rl.launch.gpus.resolve_server_gpus`, or the user's)."""
    if is_main or os.environ.get("GROUP_RANK", "0") != "0":
        return contextlib.nullcontext()
    from core_rl.loops.preflight import detect_machine

    machine = detect_machine()
    engine_config = resolve_server_gpus(cfg, machine)[0]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return held_for_trainer(shared_gpu(engine_config, built, machine, local_rank))


def release_cached_memory() -> None:
    """Return the blocks torch's caching allocator holds unused to the driver (where this process
    has set up CUDA), so that another process on the device can take them."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
