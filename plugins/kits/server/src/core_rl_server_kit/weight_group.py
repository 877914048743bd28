"""The trainer's side of a weight-update process group with inference-server workers.

The trainer's main rank is rank 0 and hosts the rendezvous store at ``tcp://address:port``; the
servers' workers join as ranks ``1 .. world_size - 1`` (their side is the servers' own
update-weights API, or a worker extension a plugin ships). The group is built the way
``torch.distributed`` builds a named non-default group (``rendezvous`` on the TCP URL, a store
prefixed with the group name, ``_new_process_group_helper``), which is also how the servers build
theirs, so both sides meet in the same store keys. Tensors are broadcast from rank 0, one call per
tensor, in the order the servers were told.

Backends: ``gloo`` (CPU tensors) and ``nccl`` (CUDA tensors; the GPU path).

This module imports only torch, so a server-side worker extension may load it by file path
(``importlib``) in the server's own environment and join with the same code.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
from collections.abc import Iterable, Iterator

import torch

_group_serials = itertools.count()


def new_group_name() -> str:
    """A group name used once: ``core_rl_weights_<pid>_<serial>``. torch keeps a name registered
    when shutting its group down fails (the peers gone) and a server connected by ``urls`` serves
    one trainer after another, so a name drawn from anything reused (an object's ``id``, which
    Python gives again once the object is collected; a restart count) can meet one still
    registered, and the group then fails to form."""
    return f"core_rl_weights_{os.getpid()}_{next(_group_serials)}"


def init_group(
    address: str, port: int, world_size: int, *, backend: str, group_name: str, timeout_s: float, rank: int = 0
) -> torch.distributed.ProcessGroup:
    """Join the group as ``rank`` (rank 0, the trainer, hosts the store). Blocks until all
    ``world_size`` ranks joined (or ``timeout_s`` passed)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    with _default_group_unbound():
        pg, _ = _new_process_group_helper(
            size,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            backend_options=None,
            timeout=timeout,
        )
    return pg


@contextlib.contextmanager
def _default_group_unbound() -> Iterator[None]:
    """The trainer's default group without its bound device while the weight group is built: torch
    builds a new NCCL group by splitting the default group's communicator when that group is bound
    to a device (as a torchrun rank's is), and a split needs every rank of the default group, which
    the servers are not in and the other trainer ranks never join: the split would hang."""
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        group.bound_device_id = None
    try:
        yield
    finally:
        if bound is not None:
            group.bound_device_id = bound


def _from_rank0() -> torch.distributed.BroadcastOptions:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


def broadcast_tensors(
    pg: torch.distributed.ProcessGroup,
    tensors: Iterable[torch.Tensor],
    device: str,
    dtypes: Iterable[torch.dtype | None] | None = None,
) -> int:
    """Broadcast each tensor from rank 0 (moved to ``device`` first, and cast to its entry of
    ``dtypes`` where that is not ``None``: the receiver's own dtype, so the link carries no more than
    the receiver keeps); return the bytes sent."""
    total = 0
    wanted = iter(dtypes) if dtypes is not None else None
    for tensor in tensors:
        dtype = next(wanted) if wanted is not None else None
        t = tensor.detach().to(device=device, dtype=dtype or tensor.dtype).contiguous()
        pg.broadcast([t], _from_rank0()).wait()
        total += t.numel() * t.element_size()
    return total


def receive_tensors(
    pg: torch.distributed.ProcessGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: str | torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving side of :func:`broadcast_tensors`: ``(name, tensor)`` in the sender's order,
    each received only when asked for, so a loader that copies each into its parameter holds one
    received tensor at a time, not a second copy of the model. The caller takes every one (the
    sender waits on each): :func:`drain` what a loader left."""
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        pg.broadcast([t], _from_rank0()).wait()
        yield name, t


def drain(received: Iterator[tuple[str, torch.Tensor]]) -> int:
    """Receive (and drop) what is left of :func:`receive_tensors`; how many tensors that was."""
    return sum(1 for _ in received)


def destroy_group(pg: torch.distributed.ProcessGroup) -> None:
    """Release the group (best effort: the peers may be gone already)."""
    try:
        torch.distributed.destroy_process_group(pg)
    except Exception:
        try:
            pg.shutdown()
        except Exception:
            pass
